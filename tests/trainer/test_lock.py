"""One run per directory (issue 24, item 3): a second tether train on a run directory in use is refused, naming the
holder;
a lock left by a killed run is free at once."""

import os
import signal
import subprocess
import sys

import pytest

from tether.cli import main
from tether.trainer import Trainer
from tether.trainer.lock import LOCK_FILE, RunDirLocked, acquire, release

HOLD = """
import sys, time
from pathlib import Path
from tether.trainer.lock import acquire
acquire(Path(sys.argv[1]))
print("held", flush=True)
time.sleep(120)
"""


@pytest.fixture
def holder(tmp_path):
    """Another process holding the lock on tmp_path/'run' (killed with SIGKILL at the end)."""
    run = tmp_path / "run"
    run.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    yield run, proc
    proc.kill()
    proc.wait()


def test_a_second_run_on_a_directory_in_use_is_refused_naming_the_holder(small_cfg, holder, capsys):
    run, proc = holder
    with pytest.raises(RunDirLocked, match=rf"in use by another tether train \(host .+, PID {proc.pid}, since .+\)"):
        Trainer(small_cfg(out=run))
    assert main(["train", "trainer.total_steps=1", f"trainer.output_dir={run}"]) == 2
    err = capsys.readouterr().err
    assert f"PID {proc.pid}" in err and "one run per directory" in err and len(err.strip().splitlines()) == 1
    assert sorted(p.name for p in run.iterdir()) == [LOCK_FILE]  # nothing written by the refused runs


def test_the_lock_of_a_killed_run_is_free_at_once(small_cfg, holder):
    run, proc = holder
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert f'"pid": {proc.pid}' in (run / LOCK_FILE).read_text()  # its note is still there; the kernel dropped the lock
    t = Trainer(small_cfg("trainer.total_steps=1", "trainer.val_freq=0", out=run))
    assert f'"pid": {os.getpid()}' in (run / LOCK_FILE).read_text()
    t.fit()
    key = acquire(run)  # fit released it: another process could take it now
    release(key)


def test_one_process_may_hold_its_own_directory_twice(small_cfg, tmp_path):
    a = Trainer(small_cfg(out=tmp_path / "r"))
    b = Trainer(small_cfg(out=tmp_path / "r"))  # e.g. a notebook cell run again
    assert a._lock == b._lock
    release(a._lock)
    release(b._lock)
