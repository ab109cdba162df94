"""Fault tests with real processes: SIGKILL during training and while a checkpoint is being written.

Each test starts ``python -m tether.cli train``, kills it, restarts it with ``trainer.resume=auto``
and checks that it continued from the last complete checkpoint and that the final metrics equal an
uninterrupted run's (computed in-process once per module).
"""

import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tether.checkpoint import FAULT_ENV, CheckpointError, latest_valid_checkpoint, verify_checkpoint
from tether.config import load_config
from tether.trainer import Trainer

pytestmark = pytest.mark.slow

# A reward that is the task's own, optionally slowed down (so that a kill lands mid-run reliably).
REWARD = """
import os
import time
from tether.tasks.digitsum import compute_score

def reward(data_sources, solution_strs, ground_truths, extra_infos):
    time.sleep(float(os.environ.get("SLOW_REWARD_S", "0")))
    return [compute_score(s, g) for s, g in zip(solution_strs, ground_truths)]
"""


def overrides(run: Path, reward: Path, *extra: str) -> list[str]:
    return [
        "trainer.progress=false",
        "trainer.threads=1",
        "trainer.report=false",
        "trainer.loggers=[jsonl]",
        "trainer.val_freq=0",
        "trainer.total_steps=6",
        "trainer.save_freq=2",
        "trainer.keep_last=2",
        "data.batch_size=4",
        "data.embedded_train_size=8",
        "rollout.n=4",
        "algo.mini_batch_size=8",
        "actor.lr=1e-3",
        "kl.controller=adaptive",
        "kl.target=0.01",
        "kl.horizon=50",
        f"reward.function={reward}:reward",
        f"trainer.output_dir={run}",
        *extra,
    ]


def numbers(rec: dict) -> dict:
    return {
        k: v
        for k, v in rec.items()
        if not k.startswith(("timing/", "perf/")) and (v is None or isinstance(v, (int, float)))
    }


def read_lines(run: Path) -> list[dict]:
    if not (run / "metrics.jsonl").exists():
        return []
    out = []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written
            pass
    return out


def assert_same(got: list[dict], want: list[dict]) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, 7))
    for g, w in zip(got, want, strict=True):
        g, w = numbers(g), numbers(w)
        assert g.keys() == w.keys(), g.keys() ^ w.keys()
        for k, v in w.items():
            assert (v is None and g[k] is None) or math.isclose(g[k], v, rel_tol=0, abs_tol=1e-6), (
                g["step"],
                k,
                g[k],
                v,
            )


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(the reward file, the uninterrupted run's metrics), the latter from an in-process run."""
    root = tmp_path_factory.mktemp("faults")
    reward = root / "reward.py"
    reward.write_text(REWARD)
    Trainer(load_config(None, overrides(root / "reference", reward))).fit()
    want = read_lines(root / "reference")
    assert len({r["kl/coef"] for r in want}) == 6  # an adaptive β that moves every step
    return reward, want


def train(run: Path, reward: Path, env: dict | None = None, extra: tuple[str, ...] = ()) -> subprocess.Popen:
    """``tether train`` in a subprocess (the fault hook only when ``env`` sets it)."""
    env = {k: v for k, v in os.environ.items() if k != FAULT_ENV} | {"OMP_NUM_THREADS": "1"} | (env or {})
    cmd = [sys.executable, "-m", "tether.cli", "train", *overrides(run, reward, *extra)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def resume_and_finish(run: Path, reward: Path, extra: tuple[str, ...] = ()) -> str:
    proc = train(run, reward, extra=extra)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    return err


#: three batches generated ahead, each weighed against a mismatched engine (TIS) with rejection, and a k3 KL loss
ASYNC_CORRECTED = (
    "rollout.async_steps=3",
    "rollout.engine_temperature=1.5",
    "algo.rollout_correction.level=token",
    "algo.rollout_correction.reject=seq_mean_k3",
    "algo.rollout_correction.reject_threshold=0.05",
    "kl.placement=both",
    "kl.loss_estimator=k3",
    "algo.mini_batch_size=8",
)


@pytest.mark.parametrize("extra", [(), ASYNC_CORRECTED], ids=["sync", "async-3-rollout-correction"])
def test_sigkill_at_a_random_step_then_resume(tmp_path, setup, extra):
    reward, want = setup
    if extra:  # its own uninterrupted run, in-process
        Trainer(load_config(None, overrides(tmp_path / "reference", reward, *extra))).fit()
        want = read_lines(tmp_path / "reference")
        assert all(r["rollout/staleness"] == min(r["step"] - 1, 3) and 0 < r["rollout_corr/ess"] < 1 for r in want)
    kill_after = random.Random(20240607).randint(3, 5)  # the step after whose metrics line the kill is sent
    run = tmp_path / "run"
    proc = train(run, reward, env={"SLOW_REWARD_S": "0.4"}, extra=extra)
    deadline = time.monotonic() + 90
    while max((r["step"] for r in read_lines(run)), default=0) < kill_after:
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline, "no progress"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    done = max(r["step"] for r in read_lines(run))
    assert kill_after <= done < 6  # killed mid-run (each step takes > 0.4 s)
    last = latest_valid_checkpoint(run / "checkpoints")
    expected = 2 * (done // 2)  # the checkpoint of the last even step logged
    assert last is not None and last.name == f"step_{expected:06d}"

    err = resume_and_finish(run, reward, extra)
    assert f"resumed from {last} (step {expected})" in err
    assert_same(read_lines(run), want)


def test_sigkill_while_writing_a_checkpoint_then_resume(tmp_path, setup):
    reward, want = setup
    run = tmp_path / "run"
    proc = train(run, reward, env={FAULT_ENV: "kill:4:optim"})
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL, err
    assert f"{FAULT_ENV}: killing this process while writing checkpoint 4 (after optim)" in err
    tmp = run / "checkpoints" / ".tmp-step_000004"
    assert (tmp / "optim.pt").is_file() and not (tmp / "trainer_state.json").exists()  # half written
    assert not (run / "checkpoints" / "step_000004").exists()
    assert [r["step"] for r in read_lines(run)] == [1, 2, 3]  # step 4 died before its line
    verify_checkpoint(run / "checkpoints" / "step_000002")

    err = resume_and_finish(run, reward)
    assert f"resumed from {run / 'checkpoints' / 'step_000002'} (step 2)" in err
    assert_same(read_lines(run), want)
    assert not tmp.exists()  # cleaned up by the next save
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000004", "step_000006"]


def test_truncated_checkpoint_named_by_the_cli_and_auto_falls_back(tmp_path, setup, capsys, caplog):
    from tether.cli import main

    reward, want = setup
    run = tmp_path / "run"
    Trainer(load_config(None, overrides(run, reward))).fit()
    opt = run / "checkpoints" / "step_000006" / "optim.pt"
    opt.write_bytes(opt.read_bytes()[:1000])
    assert main(["train", *overrides(run, reward), f"trainer.resume={opt.parent}"]) == 2
    err = capsys.readouterr().err
    assert (
        f"tether train: checkpoint {opt.parent}: file optim.pt has 1000 bytes, expected" in err
        and "(truncated?)" in err
    )
    with pytest.raises(CheckpointError, match="optim.pt"):
        verify_checkpoint(opt.parent)

    t = Trainer(load_config(None, overrides(run, reward)))
    assert t.step == 4 and "step_000006: file optim.pt has 1000 bytes" in caplog.text
    t.fit()
    assert_same(read_lines(run), want)


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_sigterm_or_sigint_finishes_the_step_checkpoints_it_and_resumes_from_it(tmp_path, setup, sig, code):
    reward, want = setup
    run = tmp_path / "run"
    proc = train(run, reward, env={"SLOW_REWARD_S": "0.4"})
    deadline = time.monotonic() + 90
    while max((r["step"] for r in read_lines(run)), default=0) < 2:
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline, "no progress"
        time.sleep(0.02)
    proc.send_signal(sig)  # lands during step 3 (each step takes > 0.4 s), which is not a save_freq step
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err
    done = max(r["step"] for r in read_lines(run))
    assert 2 <= done < 6  # 2 only if the signal beat the loop's check after step 2's own checkpoint
    assert f"{sig.name} received: finishing the step in progress" in err
    assert f"tether train: stopped by {sig.name} after step {done}; checkpoint step {done} written" in err
    assert f"trainer.output_dir={run}" in err.rsplit("To continue:", 1)[1]
    last = latest_valid_checkpoint(run / "checkpoints")
    assert last is not None and last.name == f"step_{done:06d}"  # the interrupted step itself, whole

    err = resume_and_finish(run, reward)
    assert f"resumed from {last} (step {done})" in err
    assert_same(read_lines(run), want)  # as if never interrupted


# A reward that hangs forever from its second batch on (a remote judge that stopped answering).
HANG = """
import os
import time
from tether.tasks.digitsum import compute_score

CALLS = []

def reward(data_sources, solution_strs, ground_truths, extra_infos):
    CALLS.append(1)
    if len(CALLS) >= 2:
        time.sleep(100000)
    return [compute_score(s, g) for s, g in zip(solution_strs, ground_truths)]
"""


def test_one_sigterm_stops_a_hung_step_after_the_grace_period(tmp_path):
    """Issue 24, item 1: a step hung in the reward (the default reward.timeout_s=600: the main thread waits on the
    reward's worker thread; with null the reward itself blocks the main thread, interrupted the same way: checked by
    hand) gets trainer.stop_grace_s=2 s after one SIGTERM, then is abandoned: exit 143 within seconds, with the last
    complete checkpoint (step 1) named and the resume command printed."""
    reward = tmp_path / "hang.py"
    reward.write_text(HANG)
    run = tmp_path / "run"
    proc = train(run, reward, extra=("trainer.save_freq=1", "trainer.stop_grace_s=2"))
    deadline = time.monotonic() + 90
    while max((r["step"] for r in read_lines(run)), default=0) < 1:
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline, "no progress"
        time.sleep(0.02)
    time.sleep(0.5)  # into step 2's reward, which never returns
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    assert time.monotonic() - t0 < 20
    assert "did not finish within trainer.stop_grace_s=2 s of the SIGTERM: abandoning it" in err
    assert "the last checkpoint is step 1" in err and f"trainer.output_dir={run}" in err.rsplit("To continue:", 1)[1]
    assert latest_valid_checkpoint(run / "checkpoints").name == "step_000001"
