"""``tether export``, ``tether report`` and ``tether eval --out`` on a full or read-only disk: a target
found unwritable before the work is one line (exit 2); a write that fails anyway is one line naming
the command, the path and the OS's reason (exit 4), and leaves no partial output at or beside the
target, an earlier output intact.

As root, permissions do not make a directory read-only, so the failures are injected: the lowest-level
write each command uses raises the OSError a full (ENOSPC) or read-only (EROFS) disk gives, partway
through, after leaving a truncated file as the real failure would. (A real full and read-only tmpfs
gives the same messages: docs/checkpoints.md, "Exports, reports and `eval --out` on a full or read-only disk".)
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from tether.checkpoint import write_checkpoint
from tether.cli import main
from tether.outputs import OutputWriteError, atomic_output, io_errno, output_problem
from tether.tasks.sft import default_reference_path

ENOSPC = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
EROFS = OSError(errno.EROFS, os.strerror(errno.EROFS))


def _tree(d: Path) -> dict[str, bytes | None]:
    """Every path under ``d`` (hidden ones too), with a file's bytes."""
    return {str(p.relative_to(d)): (p.read_bytes() if p.is_file() else None) for p in sorted(d.rglob("*"))}


def _one_line(err: str) -> str:
    lines = err.splitlines()
    assert len(lines) == 1, err
    return lines[0]


def _read_only(monkeypatch, *dirs: Path) -> None:
    """``os.statvfs`` says ``dirs`` are on a read-only file system (what a ``mount -o ro`` gives)."""
    real = os.statvfs
    ro = {str(d) for d in dirs}

    class _Ro:
        def __init__(self, st):
            self._st = st
            self.f_flag = st.f_flag | os.ST_RDONLY

        def __getattr__(self, name):
            return getattr(self._st, name)

    monkeypatch.setattr(os, "statvfs", lambda p: _Ro(real(p)) if str(p) in ro else real(p))


# ---------------------------------------------------------------------------------------------- outputs


def test_output_problem_finds_a_read_only_or_unwritable_directory(tmp_path, monkeypatch):
    (tmp_path / "out").mkdir()
    _read_only(monkeypatch, tmp_path)
    assert output_problem(tmp_path / "x.json", "file", "--out") == (
        f"--out {tmp_path / 'x.json'} cannot be written: {tmp_path} is on a read-only file system"
    )
    assert output_problem(tmp_path / "new" / "deeper", "dir", "OUT_DIR") == (
        f"OUT_DIR {tmp_path / 'new' / 'deeper'} cannot be written: {tmp_path} is on a read-only file system"
    )
    assert output_problem(tmp_path / "out", "dir", "--out") is None  # written in, not beside: its own directory counts
    assert "read-only file system" in output_problem(tmp_path / "out", "dir", "--out", beside=True)
    monkeypatch.undo()
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: Path(p) != tmp_path / "out")
    assert output_problem(tmp_path / "out", "dir", "--out") == (
        f"--out {tmp_path / 'out'} cannot be written: {tmp_path / 'out'} is not writable (permission denied)"
    )
    assert output_problem(tmp_path / "out" / "x.json", "file", "--out").endswith("is not writable (permission denied)")
    assert output_problem(tmp_path / "y.json", "file", "--out") is None


def test_atomic_output_leaves_nothing_on_failure(tmp_path):
    target = tmp_path / "a" / "b" / "model"
    with pytest.raises(OutputWriteError) as e, atomic_output(target, "dir") as tmp:
        assert tmp.parent == target.parent and tmp.name == f".model.tmp-{os.getpid()}" and tmp.is_dir()
        (tmp / "model.safetensors").write_bytes(b"half a model")
        raise ENOSPC
    assert str(e.value) == f"cannot write {target}: No space left on device (no partial output was left)"
    assert e.value.errno == errno.ENOSPC and list(tmp_path.iterdir()) == []  # the parents it made are gone too
    # not an I/O error: re-raised as is
    with pytest.raises(KeyError), atomic_output(tmp_path / "f.json", "file") as tmp:
        tmp.write_text("{")
        raise KeyError("bug")
    assert list(tmp_path.iterdir()) == []


def test_io_errno_reads_wrappers_text():
    from safetensors import SafetensorError

    assert (
        io_errno(SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)"))
        == errno.ENOSPC
    )
    assert io_errno(RuntimeError("rank 1: [Errno 30] Read-only file system: 'x'")) == errno.EROFS
    try:
        try:
            raise EROFS
        except OSError as e:
            raise RuntimeError("unexpected pos 64") from e
    except RuntimeError as wrapped:
        assert io_errno(wrapped) == errno.EROFS
    assert io_errno(ValueError("not an I/O error")) is None


# ---------------------------------------------------------------------------------------------- export


@pytest.fixture(scope="module")
def plain_ckpt(tmp_path_factory) -> Path:
    """A checkpoint whose actor is the embedded task's shipped reference (a full model: copied on export)."""
    root = tmp_path_factory.mktemp("plain")
    return write_checkpoint(
        root / "checkpoints", 2, {"weights": lambda d: shutil.copytree(default_reference_path(), d / "actor")}
    )


@pytest.fixture(scope="module")
def lora_ckpt(tmp_path_factory) -> Path:
    """A LoRA checkpoint on the shipped reference (merged and written with save_pretrained on export)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ref = str(default_reference_path())
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(ref), LoraConfig(r=2, target_modules=["q_proj", "v_proj"])
    )

    def weights(d):
        model.save_pretrained(d / "actor")
        AutoTokenizer.from_pretrained(ref).save_pretrained(d / "actor")

    root = tmp_path_factory.mktemp("lora")
    return write_checkpoint(root / "checkpoints", 2, {"weights": weights})


def test_export_copy_fails_on_a_full_disk_and_leaves_no_truncated_model(plain_ckpt, tmp_path, monkeypatch, capsys):
    real = shutil.copy2

    def copy2(src, dst, **kw):
        if Path(src).name == "model.safetensors":  # half the weights reach the disk, then it is full
            Path(dst).write_bytes(Path(src).read_bytes()[:1000])
            raise ENOSPC
        return real(src, dst, **kw)

    monkeypatch.setattr(shutil, "copy2", copy2)
    out = tmp_path / "hf"
    capsys.readouterr()
    assert main(["export", str(plain_ckpt), str(out)]) == 4
    assert (
        _one_line(capsys.readouterr().err)
        == f"tether export: cannot write {out}: No space left on device (no partial output was left)"
    )
    assert _tree(tmp_path) == {}  # no hf/, no .hf.tmp-<pid>/
    monkeypatch.undo()
    assert main(["export", str(plain_ckpt), str(out)]) == 0  # once the disk is fixed
    assert (out / "model.safetensors").read_bytes() == (default_reference_path() / "model.safetensors").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


@pytest.mark.parametrize(
    "failure, reason",
    [
        (lambda: EROFS, "Read-only file system"),
        (
            lambda: __import__("safetensors").SafetensorError(
                "Error while serializing: I/O error: No space left on device (os error 28)"
            ),
            "No space left on device",
        ),  # what safetensors raises on a full disk: no errno, only its text
    ],
    ids=["erofs", "safetensors-enospc"],
)
def test_export_save_pretrained_failure_keeps_an_empty_out_dir_empty(
    lora_ckpt, tmp_path, monkeypatch, capsys, failure, reason
):
    import transformers.modeling_utils as mu

    real = mu.safe_save_file

    def save_file(tensors, filename, metadata=None):
        real(tensors, filename, metadata=metadata)
        with open(filename, "r+b") as f:  # a truncated model.safetensors, as the failing write leaves it
            f.truncate(os.path.getsize(filename) // 2)
        raise failure()

    monkeypatch.setattr(mu, "safe_save_file", save_file)
    out = tmp_path / "hf"
    out.mkdir()  # an empty OUT_DIR is allowed, and stays as it was
    capsys.readouterr()
    assert main(["export", str(lora_ckpt), str(out)]) == 4
    assert (
        _one_line(capsys.readouterr().err)
        == f"tether export: cannot write {out}: {reason} (no partial output was left)"
    )
    assert _tree(tmp_path) == {"hf": None}


def test_export_refuses_a_read_only_or_too_small_target_before_writing(plain_ckpt, tmp_path, monkeypatch, capsys):
    written = []
    monkeypatch.setattr(shutil, "copy2", lambda *a, **kw: written.append(a))
    _read_only(monkeypatch, tmp_path)
    assert main(["export", str(plain_ckpt), str(tmp_path / "hf")]) == 2
    assert _one_line(capsys.readouterr().err) == (
        f"tether export: OUT_DIR {tmp_path / 'hf'} cannot be written: {tmp_path} is on a read-only file system"
    )
    monkeypatch.undo()
    monkeypatch.setattr(shutil, "copy2", lambda *a, **kw: written.append(a))
    monkeypatch.setattr(shutil, "disk_usage", lambda p: SimpleNamespace(total=10**9, used=10**9 - 4096, free=4096))
    assert main(["export", str(plain_ckpt), str(tmp_path / "hf")]) == 4
    err = _one_line(capsys.readouterr().err)
    need = sum(f.stat().st_size for f in (plain_ckpt / "actor").iterdir())  # the actor's files, copied as they are
    assert err.startswith(
        f"tether export: cannot write {tmp_path / 'hf'}: No space left on device: it needs about {need / 1024:.2f} KiB "
        f"({need} bytes), "
    )
    assert err.endswith("4.00 KiB (4096 bytes) free (nothing was written)")
    assert written == [] and _tree(tmp_path) == {}


def test_export_into_a_non_empty_directory_is_still_refused(plain_ckpt, tmp_path, capsys):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "model.safetensors").write_bytes(b"a good model")
    assert main(["export", str(plain_ckpt), str(tmp_path / "hf")]) == 2
    assert "already exists and is not an empty directory" in _one_line(capsys.readouterr().err)
    assert _tree(tmp_path) == {"hf": None, "hf/model.safetensors": b"a good model"}


# ---------------------------------------------------------------------------------------------- report


@pytest.fixture
def run(tmp_path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    rows = [
        {
            "step": s,
            "reward/score_mean": 0.1 * s,
            "kl/ref_mean": 0.01 * s,
            "kl/coef": 0.05,
            "policy/entropy": 1 - 0.1 * s,
        }
        for s in range(1, 5)
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def _savefig_fails_on_the_third(monkeypatch, error):
    from matplotlib.figure import Figure

    real, calls = Figure.savefig, []

    def savefig(self, fname, *args, **kwargs):
        calls.append(fname)
        if len(calls) == 3:
            Path(fname).write_bytes(b"\x89PNG\r\n\x1a\n truncated")
            raise error
        return real(self, fname, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig)


@pytest.mark.parametrize("error", [ENOSPC, EROFS], ids=["enospc", "erofs"])
def test_report_write_failure_leaves_the_earlier_report_intact(run, monkeypatch, capsys, error):
    assert main(["report", str(run)]) == 0
    (run / "report" / "notes.md").write_text("the user's notes\n")
    before = _tree(run)
    with open(run / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 5, "reward/score_mean": 0.9}) + "\n")
    before["metrics.jsonl"] = (run / "metrics.jsonl").read_bytes()
    capsys.readouterr()
    _savefig_fails_on_the_third(monkeypatch, error)
    assert main(["report", str(run)]) == 4
    assert _one_line(capsys.readouterr().err) == (
        f"tether report: cannot write {run / 'report'}: {error.strerror} (no partial output was left)"
    )
    assert _tree(run) == before  # every old PNG and summary.md byte for byte, no .report.tmp-<pid>/
    monkeypatch.undo()
    assert main(["report", str(run)]) == 0
    assert (run / "report" / "notes.md").read_text() == "the user's notes\n"  # carried into the new report
    assert "5 steps logged." in (run / "report" / "summary.md").read_text()
    assert sorted(p.name for p in run.iterdir()) == ["metrics.jsonl", "report"]


def test_report_failure_at_the_summary_or_the_rename_leaves_no_report(run, monkeypatch, capsys):
    real_write_text = Path.write_text

    def write_text(self, data, *args, **kwargs):
        if self.name == "summary.md":
            real_write_text(self, data[:10], *args, **kwargs)
            raise ENOSPC
        return real_write_text(self, data, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", write_text)
    assert main(["report", str(run)]) == 4
    assert (
        _one_line(capsys.readouterr().err)
        == f"tether report: cannot write {run / 'report'}: No space left on device (no partial output was left)"
    )
    assert sorted(p.name for p in run.iterdir()) == ["metrics.jsonl"]
    monkeypatch.undo()

    def replace(src, dst):
        raise EROFS

    monkeypatch.setattr(os, "replace", replace)
    assert main(["report", str(run)]) == 4
    assert "Read-only file system (no partial output was left)" in _one_line(capsys.readouterr().err)
    assert sorted(p.name for p in run.iterdir()) == ["metrics.jsonl"]


def test_report_on_a_read_only_run_is_refused_before_drawing(run, monkeypatch, capsys):
    from matplotlib.figure import Figure

    monkeypatch.setattr(Figure, "savefig", lambda *a, **kw: pytest.fail("drew on a read-only run"))
    _read_only(monkeypatch, run)
    assert main(["report", str(run)]) == 2
    assert _one_line(capsys.readouterr().err) == (
        f"tether report: the report directory {run / 'report'} cannot be written: {run} is on a read-only file system"
    )
    (run / "report").write_text("a file")
    assert main(["report", str(run)]) == 2
    assert "is a file, expected a directory" in _one_line(capsys.readouterr().err)


# ---------------------------------------------------------------------------------------------- eval --out

EVAL = ["eval", "embedded", "embedded", "--limit", "2", "--n", "2", "--max-new-tokens", "4", "--no-kl", "--no-progress"]


def test_eval_out_write_failure_keeps_the_earlier_results(tmp_path, monkeypatch, capsys):
    out = tmp_path / "res.json"
    out.write_text('{"earlier": "results"}\n')
    out.with_suffix(".txt").write_text("earlier table\n")
    real_write_text = Path.write_text

    def write_text(self, data, *args, **kwargs):
        if self.name.startswith(".res.json.tmp-"):
            real_write_text(self, data[: len(data) // 2], *args, **kwargs)  # a truncated JSON, then the disk is full
            raise ENOSPC
        return real_write_text(self, data, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", write_text)
    assert main([*EVAL, "--out", str(out)]) == 4
    captured = capsys.readouterr()
    assert "pass@1" in captured.out  # the table was printed before the write
    assert (
        _one_line(captured.err)
        == f"tether eval: cannot write {out}: No space left on device (no partial output was left)"
    )
    assert _tree(tmp_path) == {"res.json": b'{"earlier": "results"}\n', "res.txt": b"earlier table\n"}


def test_eval_out_rename_failure_and_read_only_target(tmp_path, monkeypatch, capsys):
    out = tmp_path / "sub" / "res.json"

    def replace(src, dst):
        raise EROFS

    monkeypatch.setattr(os, "replace", replace)
    assert main([*EVAL, "--out", str(out)]) == 4
    assert (
        _one_line(capsys.readouterr().err)
        == f"tether eval: cannot write {out}: Read-only file system (no partial output was left)"
    )
    assert _tree(tmp_path) == {}  # not even sub/
    monkeypatch.undo()
    _read_only(monkeypatch, tmp_path)
    monkeypatch.setattr(
        "tether.evaluation.evaluate.evaluate", lambda *a, **kw: pytest.fail("evaluated with a read-only --out")
    )
    assert main([*EVAL, "--out", str(out)]) == 2
    assert (
        _one_line(capsys.readouterr().err)
        == f"tether eval: --out {out} cannot be written: {tmp_path} is on a read-only file system"
    )
