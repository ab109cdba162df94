"""Checkpoints that are complete or absent: atomic directories, a checksummed manifest, safe loading.

Layout of ``<output_dir>/checkpoints/step_000100/``::

    actor/                  save_pretrained directory (safetensors + config + tokenizer), or the
                            LoRA adapter directory when actor.lora.rank > 0
    critic.safetensors      value model state (algo.adv_estimator=gae only)
    optim.pt                optimizer + LR-scheduler states (tensors only; loaded weights_only=True)
    rng.json                python, numpy and torch (CPU, CUDA) RNG states
    trainer_state.json      step, KL controller, data position, guard, reward normaliser, best score
    MANIFEST.json           size and sha256 of every file above; written last = the completeness marker

A checkpoint is written into ``.tmp-step_000100`` and renamed when complete, so a crash mid-write
never leaves a directory that looks whole. Nothing is unpickled on load: safetensors, JSON, and
``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger("tether")

MANIFEST = "MANIFEST.json"
_STEP_RE = re.compile(r"^step_(\d{6,})$")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or corrupt. The message names the file."""


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


def write_checkpoint(ckpt_root: Path, step: int, writers: dict) -> Path:
    """Write a checkpoint atomically.

    Args:
        ckpt_root: ``<output_dir>/checkpoints``.
        writers: name -> callable(tmp_dir) that writes that part into the temporary directory.
    Returns:
        The final directory. Any earlier checkpoint of the same step is replaced.
    """
    ckpt_root.mkdir(parents=True, exist_ok=True)
    final = ckpt_root / step_dir_name(step)
    tmp = ckpt_root / f".tmp-{step_dir_name(step)}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    for write in writers.values():
        write(tmp)
    files = sorted(p for p in tmp.rglob("*") if p.is_file())
    manifest = {
        "step": step,
        "files": {str(p.relative_to(tmp)): {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in files},
    }
    for p in files:
        with p.open("rb+") as f:
            os.fsync(f.fileno())
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
    _fsync_dir(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(ckpt_root)
    return final


def verify_checkpoint(path: Path) -> dict:
    """Check a checkpoint's manifest, sizes and checksums; return the manifest.

    Raises:
        CheckpointError: naming the checkpoint and the missing, truncated or altered file.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist")
    mpath = path / MANIFEST
    if not mpath.is_file():
        raise CheckpointError(f"checkpoint {path} is incomplete: no {MANIFEST} (the write did not finish)")
    try:
        manifest = json.loads(mpath.read_text())
    except json.JSONDecodeError:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is corrupt") from None
    for rel, meta in manifest["files"].items():
        f = path / rel
        if not f.is_file():
            raise CheckpointError(f"checkpoint {path}: file {rel} is missing")
        size = f.stat().st_size
        if size != meta["bytes"]:
            raise CheckpointError(f"checkpoint {path}: file {rel} has {size} bytes, expected {meta['bytes']} (truncated?)")
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


def latest_valid_checkpoint(ckpt_root: Path) -> Path | None:
    """The newest checkpoint that verifies; corrupt or incomplete ones are reported and skipped."""
    for _, p in list_checkpoints(ckpt_root):
        try:
            verify_checkpoint(p)
            return p
        except CheckpointError as e:
            log.warning("resume: skipping %s", e)
    return None


def prune_checkpoints(ckpt_root: Path, keep_last: int, protect: set[int]) -> None:
    """Delete all but the newest ``keep_last`` checkpoints and the protected steps (best, stable)."""
    ckpts = list_checkpoints(ckpt_root)
    for i, (step, p) in enumerate(ckpts):
        if i >= keep_last and step not in protect:
            shutil.rmtree(p, ignore_errors=True)
    for p in ckpt_root.glob(".tmp-step_*"):
        shutil.rmtree(p, ignore_errors=True)


def save_torch(obj, path: Path) -> None:
    torch.save(obj, path)


def load_torch(path: Path):
    """Tensor-only deserialisation: never unpickles arbitrary objects."""
    return torch.load(path, map_location="cpu", weights_only=True)


def write_json(obj, path: Path) -> None:
    path.write_text(json.dumps(obj, indent=1))


def read_json(path: Path):
    return json.loads(Path(path).read_text())
