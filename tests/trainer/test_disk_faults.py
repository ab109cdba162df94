"""Checkpoints on a full or read-only disk (issue 24, item 4): one line saying why, with the bytes needed against those
free; the partial write removed; the run stopped with the latest complete checkpoint as its resume point. The OSError
is injected at the write (TETHER_CHECKPOINT_FAULT=enospc|erofs:<step>:<point>): as root, permissions cannot make a
directory read-only here, and filling a real disk is no test."""

import shutil
from collections import namedtuple

import pytest

from tether import checkpoint as ckpt_mod
from tether.checkpoint import FAULT_ENV, CheckpointWriteError
from tether.cli import main
from tether.trainer import Trainer

QUICK = ["trainer.total_steps=3", "trainer.save_freq=1", "trainer.val_freq=0", "trainer.report=false"]


def _step_dirs(run):
    return sorted(p.name for p in (run / "checkpoints").iterdir())


@pytest.mark.parametrize(
    "fault, why",
    [
        (
            "enospc",
            r"no space left on device: it needs about 0\.\d\d GiB \(\d+ bytes\) \(the size of the last checkpoint\), "
            r"[\d.]+ GiB \(\d+ bytes\) free",
        ),
        ("erofs", "read-only file system: the directory cannot be written"),
    ],
)
def test_a_checkpoint_that_cannot_be_written_stops_the_run_cleanly(small_cfg, tmp_path, monkeypatch, fault, why):
    run = tmp_path / "run"
    monkeypatch.setenv(FAULT_ENV, f"{fault}:2:optim")  # after the weights are written: a partial checkpoint on disk
    with pytest.raises(
        CheckpointWriteError,
        match=rf"checkpoint step 2 not written to {run / 'checkpoints'}: {why}; the partial write was removed",
    ):
        Trainer(small_cfg(*QUICK, out=run)).fit()
    assert _step_dirs(run) == ["step_000001"]  # no .tmp-step_000002 left; step 1 is the resume point


def test_too_little_free_space_is_refused_before_writing(small_cfg, tmp_path, monkeypatch):
    """Once step 1's checkpoint exists its size is what the next one needs; 10 bytes free refuses step 2 up front."""
    run = tmp_path / "run"
    real = shutil.disk_usage
    usage = namedtuple("usage", "total used free")
    written = []
    monkeypatch.setattr(
        ckpt_mod.shutil,
        "disk_usage",
        lambda p: usage(10**9, 10**9 - 10, 10) if (run / "checkpoints" / "step_000001").exists() else real(p),
    )
    monkeypatch.setattr(ckpt_mod, "_seal", lambda *a, _seal=ckpt_mod._seal: written.append(a[3]) or _seal(*a))
    with pytest.raises(
        CheckpointWriteError,
        match=r"no space left on device: it needs about 0\.\d\d GiB \(\d+ bytes\) \(the size of the last checkpoint\), "
        r"0\.00 GiB \(10 bytes\) free",
    ):
        Trainer(small_cfg(*QUICK, out=run)).fit()
    assert _step_dirs(run) == ["step_000001"] and written == [1]  # step 2 never reached its writers


def test_the_cli_says_it_in_one_line_and_how_to_continue(tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    monkeypatch.setenv(FAULT_ENV, "enospc:2:weights")
    args = [
        "train",
        *QUICK,
        "trainer.progress=false",
        "data.batch_size=4",
        "rollout.n=4",
        "algo.mini_batch_size=16",
        "data.embedded_train_size=8",
        f"trainer.output_dir={run}",
    ]
    assert main(args) == 4
    err = capsys.readouterr().err
    line = next(x for x in err.splitlines() if x.startswith("tether train: "))
    assert (
        "checkpoint step 2 not written" in line
        and "no space left on device" in line
        and "the last complete checkpoint is step 1" in line
    )
    assert f"trainer.output_dir={run}" in err.split("To continue once the disk is fixed:", 1)[1]


def test_a_ray_worker_groups_error_text_is_read_for_the_os_reason(tmp_path):
    """Under trainer.backend=ray the ranks' DCP errors reach the driver as text
    (tether.distributed.ray_backend.failure_text)."""
    from tether.checkpoint import write_checkpoint

    def ranks_failed(d):
        raise RuntimeError(
            "actor group: save failed: CheckpointException (rank 0: OSError: [Errno 28] No space left on device; rank "
            "1: OSError: [Errno 28] No space left on device)"
        )

    with pytest.raises(
        CheckpointWriteError,
        match=r"checkpoint step 3 not written to .*: no space left on device: its size is unknown \(no earlier "
        r"checkpoint\), [\d.]+ GiB \(\d+ bytes\) free; the partial write was removed",
    ):
        write_checkpoint(tmp_path / "checkpoints", 3, {"weights": ranks_failed})
    assert list((tmp_path / "checkpoints").iterdir()) == []


def test_a_rank_that_dies_while_writing_is_a_worker_failure_not_the_disks(tmp_path):
    """A rank killed during its checkpoint shard reaches write_checkpoint as a WorkerDiedError with no OS reason:
    tether train reports the dead rank (exit 5), not a disk to fix; a rank's full disk stays the disk's (exit 4)."""
    from tether.checkpoint import write_checkpoint
    from tether.cli import worker_failure
    from tether.distributed.errors import WorkerDiedError

    def fails(text):
        def write(d):
            raise WorkerDiedError(text)

        return write

    died = "actor+ref worker group: rank 1 died during save_checkpoint (ActorDiedError: killed); the run cannot go on"
    full = (
        "actor+ref worker group: rank 0 failed in save_checkpoint: CheckpointException (rank 0: OSError: [Errno 28] No "
        "space left on device)"
    )
    with pytest.raises(CheckpointWriteError) as info:
        write_checkpoint(tmp_path / "checkpoints", 3, {"weights": fails(died)})
    assert worker_failure(info.value) and info.value.errno == 0
    with pytest.raises(CheckpointWriteError) as info:
        write_checkpoint(tmp_path / "checkpoints", 3, {"weights": fails(full)})
    assert not worker_failure(info.value) and "no space left on device" in str(info.value)
    assert worker_failure(WorkerDiedError(died)) and not worker_failure(RuntimeError("a bug"))


#: what torch.save raises when the disk fills under it (no errno): its zip writer's short write
TORCH_SHORT_WRITE = "[enforce fail at inline_container.cc:626] . unexpected pos 407872 vs 407764"


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError(TORCH_SHORT_WRITE),
        RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed"),
        OSError(28, "No space left on device"),
        Exception('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left" })'),
    ],
    ids=["torch-unexpected-pos", "torch-file-write-failed", "oserror-enospc", "safetensors"],
)
def test_a_full_disk_on_the_first_checkpoint_is_named_so(tmp_path, monkeypatch, capsys, error):
    """The first checkpoint has no earlier one to size it, and torch.save says a full disk only as a short write
    ("unexpected pos 407872 vs 407764"): the line is the same disk-full one, with the bytes written before the disk
    filled (the 1000 of the partial file) as the least it needs, exit 4, and the command that starts again."""
    from tether.workers import roles

    partial = []

    def save_torch_on_a_full_disk(obj, path):
        path.write_bytes(b"x" * 1000)  # torch got this far
        partial.append(sum(p.stat().st_size for p in path.parent.rglob("*") if p.is_file()))  # actor/ and these
        raise error

    monkeypatch.setattr(roles, "save_torch", save_torch_on_a_full_disk)
    run = tmp_path / "run"
    args = ["train", *QUICK, "trainer.progress=false", "data.batch_size=4", "rollout.n=4", "algo.mini_batch_size=16"]
    assert main([*args, "data.embedded_train_size=8", f"trainer.output_dir={run}"]) == 4
    line = next(x for x in capsys.readouterr().err.splitlines() if x.startswith("tether train: "))
    assert len(partial) == 1 and partial[0] > 1000
    assert line.startswith(
        f"tether train: checkpoint step 1 not written to {run / 'checkpoints'}: no space left on device: it needs more "
        f"than the {partial[0] / 2**30:.2f} GiB ({partial[0]} bytes) written before the disk filled (no earlier "
        "checkpoint), "
    ), line
    assert line.endswith(
        "free; the partial write was removed; no checkpoint was written yet. To continue once the disk is fixed:"
    ), line
    assert list((run / "checkpoints").iterdir()) == []
