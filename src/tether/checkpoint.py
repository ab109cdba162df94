"""Checkpoints that are complete or absent: atomic directories, a checksummed manifest, safe loading.

Layout of ``<output_dir>/checkpoints/step_000100/``::

    actor/                  save_pretrained directory (safetensors + config + tokenizer), or the
                            LoRA adapter directory when actor.lora.rank > 0
    critic.safetensors      value model state (algo.adv_estimator=gae only)
    optim.pt                optimizer + LR-scheduler states (tensors only; loaded weights_only=True)
    rng.json                python, numpy and torch (CPU, CUDA) RNG states
    trainer_state.json      step, KL controller, data position, guard, reward normaliser, best score
    async_pending.safetensors  rollout.async_steps: the batches generated for the next steps (token ids,
                            behaviour log-probs; ``tether.trainer.async_rollout``)
    MANIFEST.json           size and sha256 of every file above; written last = the completeness marker

A checkpoint is written into ``.tmp-step_000100`` and renamed when complete, so a crash mid-write
never leaves a directory that looks whole. Nothing is unpickled on load: safetensors, JSON, and
``torch.load(weights_only=True)``.

Test-only fault hook: with the environment variable ``TETHER_CHECKPOINT_FAULT=kill:<step>[:<point>]``
the process SIGKILLs itself while writing checkpoint ``<step>``, after the part ``<point>`` (one of
``weights``, ``optim``, ``state``, ``manifest``; default ``weights``) is in the temporary directory.
Unset (always, outside the fault tests) it does nothing.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import random
import re
import shutil
import signal
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger("tether")

MANIFEST = "MANIFEST.json"
FORMAT = 1
FAULT_ENV = "TETHER_CHECKPOINT_FAULT"
FAULT_POINTS = ("weights", "optim", "state", "manifest")
_STEP_RE = re.compile(r"^step_(\d{6,})$")


class CheckpointError(RuntimeError, ValueError):
    """A checkpoint is missing, incomplete or corrupt. The message names the checkpoint and the file.

    Also a ValueError: like a bad config value, it is a bad input the user names (``trainer.resume``,
    ``tether export``), reported on one line by the command line.
    """


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (a full disk, a read-only or vanished directory). The message says
    why in one line, names the directory and, for a full disk, the bytes needed against those free; the
    partial write is removed, so the latest complete checkpoint stays the resume point."""


#: the test-only faults besides kill: an OSError with this errno at (step, point), as a full or read-only disk gives
_FAULT_ERRNOS = {"enospc": errno.ENOSPC, "erofs": errno.EROFS}


def _fault_spec() -> tuple[str, int, str] | None:
    """(kind, step, point) of the test-only hook, None when unset.

    Raises:
        ValueError: a malformed spec (naming the variable).
    """
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return None
    parts = spec.split(":")
    kinds = ("kill", *_FAULT_ERRNOS)
    if (
        len(parts) not in (2, 3)
        or parts[0] not in kinds
        or not parts[1].isdigit()
        or (len(parts) == 3 and parts[2] not in FAULT_POINTS)
    ):
        raise ValueError(
            f"{FAULT_ENV}={spec!r}: expected {'|'.join(kinds)}:<step>[:<point>], point one of {', '.join(FAULT_POINTS)}"
        )
    return parts[0], int(parts[1]), parts[2] if len(parts) == 3 else "weights"


def _fault_point(step: int, point: str) -> None:
    """The test-only hook of the module docstring: SIGKILL this process (``kill``), or raise the OSError of a full
    (``enospc``) or read-only (``erofs``) disk, at (step, point) if asked."""
    fault = _fault_spec()
    if fault is None or fault[1:] != (step, point):
        return
    if fault[0] in _FAULT_ERRNOS:
        code = _FAULT_ERRNOS[fault[0]]
        raise OSError(code, os.strerror(code))
    log.warning("%s: killing this process while writing checkpoint %d (after %s)", FAULT_ENV, step, point)
    for h in logging.getLogger().handlers + log.handlers:
        h.flush()
    os.kill(os.getpid(), getattr(signal, "SIGKILL", signal.SIGTERM))


def _tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _expected_bytes(ckpt_root: Path, step: int) -> int | None:
    """The size of the newest other complete checkpoint (the same model and optimizer: the same size), bytes."""
    others = [
        p for p in ckpt_root.glob("step_*") if p.is_dir() and p.name != step_dir_name(step) and (p / MANIFEST).is_file()
    ]
    return _tree_bytes(max(others, key=lambda p: p.name)) if others else None


#: an errno in an error's text: Python's OSError (a Ray worker group's error gives each rank's as text), Rust's
#: io::Error (safetensors: "(os error 28)", or its Debug form "Os { code: 28, ...")
_ERRNO_TEXT = re.compile(r"\[Errno (\d+)\]|\(os error (\d+)\)|Os \{ code: (\d+)")
#: torch.save's short write, which is how it reports a full disk: no errno, "[enforce fail at inline_container.cc:N]
#: . unexpected pos 407872 vs 407764", or "PytorchStreamWriter failed writing file data/0: file write failed"
_SHORT_WRITE = re.compile(r"unexpected pos \d+ vs \d+|file write failed")


def _write_failure(
    e: BaseException, ckpt_root: Path, step: int, expected: int | None, written: int = 0
) -> CheckpointWriteError:
    """One line for a failed write: the OS's reason (ENOSPC, EROFS, ...), found also under torch's and DCP's
    wrappers, in the text of a Ray worker group's error, and behind torch.save's short write (``written``: the
    bytes of the partial checkpoint, the least a whole one needs)."""
    cause, seen = e, set()
    while cause is not None and id(cause) not in seen and not isinstance(cause, OSError):
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    free = shutil.disk_usage(ckpt_root).free if ckpt_root.exists() else None
    code = getattr(cause, "errno", None)
    if code is None and (m := _ERRNO_TEXT.search(str(e))):
        code = int(next(g for g in m.groups() if g))
    if code is None and (
        _SHORT_WRITE.search(str(e)) or (free is not None and expected is not None and free < expected)
    ):
        code = errno.ENOSPC  # torch.save reports a full disk as "unexpected pos ..." with no errno
    if code == errno.ENOSPC:
        if expected:
            need = f"it needs about {_gib(expected)} (the size of the last checkpoint)"
        elif written:
            need = f"it needs more than the {_gib(written)} written before the disk filled (no earlier checkpoint)"
        else:
            need = "its size is unknown (no earlier checkpoint)"
        why = f"no space left on device: {need}, {_gib(free)} free"
    elif code in (errno.EROFS, errno.EACCES, errno.EPERM):
        why = f"{os.strerror(code).lower()}: the directory cannot be written"
    else:
        why = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    return CheckpointWriteError(
        code or 0, f"checkpoint step {step} not written to {ckpt_root}: {why}; the partial write was removed"
    )


def _gib(n: int | None) -> str:
    return "? GiB" if n is None else f"{n / 2**30:.2f} GiB ({n} bytes)"


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(str(path), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def rng_state() -> dict:
    """Every RNG the trainer draws from, as JSON-serialisable data."""
    py = random.getstate()
    np_state = np.random.get_state()
    state = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "torch": torch.get_rng_state().tolist(),
    }
    if torch.cuda.is_available():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), n[2], n[3], n[4]))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])


def write_checkpoint(ckpt_root: Path, step: int, writers: dict, verified: dict | None = None) -> Path:
    """Write a checkpoint atomically.

    Args:
        ckpt_root: ``<output_dir>/checkpoints``.
        writers: name -> callable(tmp_dir) that writes that part into the temporary directory.
        verified: :func:`prune_checkpoints`' cache; the new checkpoint is entered in it (its files
            were just hashed for the manifest).
    Returns:
        The final directory. Any earlier checkpoint of the same step is replaced.

    Raises:
        CheckpointWriteError: the write failed (full disk, read-only directory, ...), or the free space is
            below the size of the last checkpoint before anything is written; the temporary directory is removed.
    """
    _fault_spec()  # a malformed test hook is an error of its own, before anything is written
    final = ckpt_root / step_dir_name(step)
    tmp = ckpt_root / f".tmp-{step_dir_name(step)}"
    expected = _expected_bytes(ckpt_root, step) if ckpt_root.is_dir() else None
    if expected is not None and shutil.disk_usage(ckpt_root).free < expected:  # refuse before writing a byte
        raise _write_failure(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), ckpt_root, step, expected)
    try:
        ckpt_root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        for name, write in writers.items():
            write(tmp)
            _fault_point(step, name)
        return _seal(ckpt_root, tmp, final, step, verified)
    except Exception as e:  # a full or read-only disk, from any writer (torch, safetensors, DCP, json)
        try:
            written = _tree_bytes(tmp) if tmp.is_dir() else 0
        except OSError:  # a vanished or unreadable directory: its size is no clue
            written = 0
        shutil.rmtree(tmp, ignore_errors=True)
        raise _write_failure(e, ckpt_root, step, expected, written) from e


def _seal(ckpt_root: Path, tmp: Path, final: Path, step: int, verified: dict | None) -> Path:
    """Manifest, fsyncs and the atomic rename of a written temporary checkpoint directory."""
    files = sorted(p for p in tmp.rglob("*") if p.is_file())
    manifest = {
        "format": FORMAT,
        "step": step,
        "files": {p.relative_to(tmp).as_posix(): {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in files},
    }
    for p in files:
        with p.open("rb+") as f:
            os.fsync(f.fileno())
    for d in {p.parent for p in files} | {tmp}:
        _fsync_dir(d)
    with (tmp / MANIFEST).open("w") as f:
        f.write(json.dumps(manifest, indent=1))
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    _fault_point(step, "manifest")
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(ckpt_root)
    if verified is not None:
        verified[str(final)] = _file_stats(final)
    return final


def verify_checkpoint(path: Path, only: str | None = None) -> dict:
    """Check a checkpoint's manifest, sizes and checksums; return the manifest.

    Args:
        only: check only the files under this prefix of the manifest (e.g. ``"actor/"``: what an
            export needs); None checks every file.

    Raises:
        CheckpointError: naming the checkpoint and the missing, truncated or altered file.
    """
    path = Path(path)
    if path.is_file():
        raise CheckpointError(
            f"checkpoint {path} is a file, not a checkpoint directory (a checkpoints/step_NNNNNN directory of a run)"
        )
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist")
    mpath = path / MANIFEST
    if not mpath.is_file() and (path / "checkpoints").is_dir():
        steps = [p.name for _, p in list_checkpoints(path / "checkpoints")]
        raise CheckpointError(
            f"checkpoint {path} is a run directory, not one of its checkpoints: give {path / 'checkpoints'}/<step> "
            f"({', '.join(steps[-3:]) or 'none written yet'}), or set trainer.output_dir={str(path)!r} with "
            "trainer.resume=auto to continue the run"
        )
    if not mpath.is_file():
        raise CheckpointError(f"checkpoint {path}: incomplete (no {MANIFEST}: the write did not finish)")
    try:
        manifest = json.loads(mpath.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise CheckpointError(f"checkpoint {path}: file {MANIFEST} is corrupt (not JSON)") from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if (
        not isinstance(files, dict)
        or not files
        or not all(isinstance(m, dict) and {"bytes", "sha256"} <= m.keys() for m in files.values())
    ):
        raise CheckpointError(f"checkpoint {path}: file {MANIFEST} is corrupt (no file list)")
    if only is not None and not any(rel.startswith(only) for rel in files):
        raise CheckpointError(f"checkpoint {path}: file {MANIFEST} lists no {only} files")
    for rel, meta in files.items():
        if Path(rel).is_absolute() or ".." in Path(rel).parts:
            raise CheckpointError(f"checkpoint {path}: file {MANIFEST} names a path outside the checkpoint: {rel!r}")
        if only is not None and not rel.startswith(only):
            continue
        f = path / rel
        if not f.is_file():
            raise CheckpointError(f"checkpoint {path}: file {rel} is missing")
        size = f.stat().st_size
        if size != meta["bytes"]:
            raise CheckpointError(
                f"checkpoint {path}: file {rel} has {size} bytes, expected {meta['bytes']} (truncated?)"
            )
        if _sha256(f) != meta["sha256"]:
            raise CheckpointError(f"checkpoint {path}: file {rel} fails its sha256 check (corrupt)")
    return manifest


def list_checkpoints(ckpt_root: Path) -> list[tuple[int, Path]]:
    """(step, path) of every ``step_*`` directory, newest first (complete or not)."""
    if not ckpt_root.is_dir():
        return []
    out = []
    for p in ckpt_root.iterdir():
        m = _STEP_RE.match(p.name)
        if m and p.is_dir():
            out.append((int(m.group(1)), p))
    return sorted(out, reverse=True)


def latest_valid_checkpoint(ckpt_root: Path, errors: list[str] | None = None, only: str | None = None) -> Path | None:
    """The newest checkpoint that verifies; corrupt or incomplete ones are reported and skipped.

    Args:
        errors: if given, the message of every skipped checkpoint is appended to it.
        only: verify only the files under this prefix (see :func:`verify_checkpoint`).
    """
    for _, p in list_checkpoints(ckpt_root):
        try:
            verify_checkpoint(p, only=only)
            return p
        except CheckpointError as e:
            log.warning("skipping %s", e)
            if errors is not None:
                errors.append(str(e))
    return None


def prune_checkpoints(ckpt_root: Path, keep_last: int, protect: set[int], verified: dict | None = None) -> list[Path]:
    """Delete all but the newest ``keep_last`` complete checkpoints and the protected steps (best, stable).

    Only checkpoints that verify (:func:`verify_checkpoint`) count toward ``keep_last``, so a corrupt
    or incomplete newer one never pushes a valid one out. Such a checkpoint is not deleted either: it
    is renamed ``corrupt-step_N`` (out of resume's and pruning's way, kept for inspection) with a
    warning naming the damaged file. Leftover ``.tmp-`` directories are deleted.

    Args:
        verified: a cache, kept by the caller across saves, of the checkpoints that verified
            (path -> the sizes and mtimes of their files then), so each one is hashed once rather
            than at every save; None verifies every checkpoint each time.

    Returns:
        The paths the corrupt or incomplete checkpoints were moved to.
    """
    moved, kept = [], 0
    for step, p in list_checkpoints(ckpt_root):
        if not _verifies(p, verified):
            moved.append(_set_aside(p))
            continue
        if kept >= keep_last and step not in protect:
            shutil.rmtree(p, ignore_errors=True)
            if verified is not None:
                verified.pop(str(p), None)
            continue
        kept += 1
    for p in ckpt_root.glob(".tmp-step_*"):
        shutil.rmtree(p, ignore_errors=True)
    return moved


def _file_stats(path: Path) -> tuple:
    return tuple(
        sorted(
            (q.relative_to(path).as_posix(), q.stat().st_size, q.stat().st_mtime_ns)
            for q in path.rglob("*")
            if q.is_file()
        )
    )


def _verifies(path: Path, verified: dict | None) -> bool:
    """Whether ``path`` verifies; a checkpoint whose files are as they were when it last verified is
    not hashed again (``verified``: see :func:`prune_checkpoints`)."""
    if verified is not None and verified.get(str(path)) == _file_stats(path):
        return True
    try:
        verify_checkpoint(path)
    except CheckpointError as e:
        log.warning("checkpoint pruning: %s", e)
        return False
    if verified is not None:
        verified[str(path)] = _file_stats(path)
    return True


def _set_aside(path: Path) -> Path:
    """Rename a checkpoint that fails verification to ``corrupt-step_N`` (``-1``, ``-2``, ... if taken)."""
    target = path.with_name(f"corrupt-{path.name}")
    i = 0
    while target.exists():
        i += 1
        target = path.with_name(f"corrupt-{path.name}-{i}")
    os.replace(path, target)
    log.warning(
        "checkpoint pruning: %s fails verification; moved it to %s (not counted toward trainer.keep_last, never "
        "resumed from; delete it once inspected)",
        path,
        target.name,
    )
    return target


def save_torch(obj, path: Path) -> None:
    torch.save(obj, path)


def load_torch(path: Path):
    """Tensor-only deserialisation: never unpickles arbitrary objects."""
    return torch.load(path, map_location="cpu", weights_only=True)


def write_json(obj, path: Path) -> None:
    path.write_text(json.dumps(obj, indent=1))


def read_json(path: Path):
    return json.loads(Path(path).read_text())
