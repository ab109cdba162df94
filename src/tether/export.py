"""``tether export CHECKPOINT_OR_RUN OUT_DIR``: a checkpoint's actor as a Hugging Face model directory."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from tether.checkpoint import MANIFEST, CheckpointError, latest_valid_checkpoint, verify_checkpoint
from tether.outputs import atomic_output, check_free_space, output_problem

log = logging.getLogger("tether")

#: What an export reads of a checkpoint: the actor's weights, config and tokenizer.
ACTOR = "actor/"


def resolve_checkpoint(path: str | Path) -> Path:
    """The checkpoint an export reads: ``path`` itself, or a run directory's latest checkpoint whose
    actor files verify (as ``tether eval`` takes a run directory).

    Only the ``actor/`` files are verified: a checkpoint whose optimizer or trainer state alone is
    damaged still exports (with a warning), since an export needs only the weights.

    Raises:
        CheckpointError: ``path`` does not exist; is a model directory, a peft adapter or something
            else that is not a checkpoint (saying what it is); is a run directory without a checkpoint
            whose actor verifies; or is a checkpoint whose actor files are missing or corrupt.
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise CheckpointError(
            f"{p} does not exist (expected a checkpoint, runs/<run>/checkpoints/step_N, or a run directory)"
        )
    if (p / "checkpoints").is_dir():  # a run directory
        errors: list[str] = []
        ckpt = latest_valid_checkpoint(p / "checkpoints", errors, only=ACTOR)
        if ckpt is None:
            why = "; ".join(errors) if errors else "it has none yet"
            raise CheckpointError(f"run directory {p} holds no checkpoint with complete actor weights: {why}")
        log.info("export: run directory %s: exporting its latest checkpoint, %s", p, ckpt.name)
        return ckpt
    if (p / MANIFEST).is_file() or (p / "actor").is_dir() or p.name.startswith("step_"):
        verify_checkpoint(p, only=ACTOR)
        return p
    if (p / "adapter_config.json").is_file():
        raise CheckpointError(
            f"{p} is a peft adapter directory, not a tether checkpoint; load it with peft.AutoPeftModelForCausalLM and "
            "merge_and_unload() to get a plain model"
        )
    if (p / "config.json").is_file():
        raise CheckpointError(
            f"{p} is a Hugging Face model directory (config.json), not a tether checkpoint: it already loads with "
            "from_pretrained, there is nothing to export"
        )
    raise CheckpointError(
        f"{p} is not a tether checkpoint (no actor/ or {MANIFEST}) nor a run directory (no checkpoints/)"
    )


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path) -> Path:
    """Write a ``save_pretrained`` directory (safetensors, config, tokenizer) that
    ``AutoModelForCausalLM.from_pretrained`` loads. A LoRA checkpoint is merged into its base model.

    The directory is written whole or not at all: into ``.<OUT_DIR name>.tmp-<pid>/`` beside it, renamed
    to ``out_dir`` only when every file is written (:func:`tether.outputs.atomic_output`), so a full or
    read-only disk never leaves a truncated ``model.safetensors`` that looks like a model.

    Args:
        checkpoint: a checkpoint directory, or a run directory (its latest checkpoint whose actor
            verifies; see :func:`resolve_checkpoint`).
        out_dir: must not exist or be empty: an export never deletes anything.

    Raises:
        CheckpointError: see :func:`resolve_checkpoint`; no actor weights; ``out_dir`` is a
            non-empty directory or a file, lies under a file, or its directory is read-only
            (:func:`tether.outputs.output_problem`), all found before anything is read or written.
        OutputWriteError: less free space than the weights need (found before writing), or a write
            failed (no space left, a read-only file system, ...): nothing was left at or beside ``out_dir``.
    """
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"{out} already exists and is not an empty directory; choose a new OUT_DIR")
    if problem := output_problem(out, "dir", "OUT_DIR", beside=True):
        raise CheckpointError(problem)
    ckpt = resolve_checkpoint(checkpoint)
    try:
        verify_checkpoint(ckpt)
    except CheckpointError as e:
        log.warning("export: %s; the actor's files verify, which is all an export reads", e)
    src = ckpt / "actor"
    if (ckpt / "dcp").is_dir() and not (src / "adapter_config.json").is_file():
        return _export_sharded(ckpt, out)
    if (src / "adapter_config.json").is_file():
        from peft import AutoPeftModelForCausalLM
        from transformers import AutoTokenizer

        model = AutoPeftModelForCausalLM.from_pretrained(str(src)).merge_and_unload()
        return _save_model(model, AutoTokenizer.from_pretrained(str(src)), out)
    if not (src / "config.json").is_file():
        raise CheckpointError(f"checkpoint {ckpt}: file actor/config.json is missing")
    if not any(src.glob("*.safetensors")):
        raise CheckpointError(f"checkpoint {ckpt}: no actor/*.safetensors weights")

    files = [f for f in sorted(src.iterdir()) if f.is_file()]
    check_free_space(out, sum(f.stat().st_size for f in files))
    with atomic_output(out, "dir") as tmp:
        for f in files:
            shutil.copy2(f, tmp / f.name)
    return out


def _save_model(model, tokenizer, out: Path) -> Path:
    """``save_pretrained`` of the model and its tokenizer into ``out``, whole or not at all.

    Raises:
        OutputWriteError: see :func:`export_checkpoint`.
    """
    seen, need = set(), 0
    for t in model.state_dict().values():  # tied weights once
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            need += t.numel() * t.element_size()
    check_free_space(out, need)
    with atomic_output(out, "dir") as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
    return out


def _export_sharded(ckpt: Path, out: Path) -> Path:
    """A trainer.backend=ray checkpoint: :func:`load_sharded_actor`, then ``save_pretrained``."""
    from transformers import AutoTokenizer

    return _save_model(load_sharded_actor(ckpt), AutoTokenizer.from_pretrained(str(ckpt / "actor")), out)


def load_sharded_actor(ckpt: str | Path):
    """The actor of a trainer.backend=ray checkpoint as a Hugging Face model on the CPU: rebuilt from
    ``actor/config.json``, its weights read from the torch.distributed.checkpoint shards in ``dcp/``
    in this one process, whatever world size wrote them.

    Raises:
        CheckpointError: ``actor/config.json`` or the shards' ``.metadata`` is missing.
    """
    import torch
    import torch.distributed.checkpoint as dcp
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    ckpt = Path(ckpt)
    src = ckpt / "actor"
    for need in (src / "config.json", ckpt / "dcp" / ".metadata"):
        if not need.is_file():
            raise CheckpointError(f"checkpoint {ckpt}: file {need.relative_to(ckpt)} is missing")
    config = AutoConfig.from_pretrained(str(src))
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(config, "dtype", None) or torch.float32)
    state = {"actor": {"model": model.state_dict()}}
    dcp.load(state, checkpoint_id=str(ckpt / "dcp"))  # fills the tensors in place; no process group needed
    model.load_state_dict(state["actor"]["model"])
    if (src / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(str(src))
    return model
