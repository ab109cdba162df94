"""``tether export CHECKPOINT_OR_RUN OUT_DIR``: a checkpoint's actor as a Hugging Face model directory."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from tether.trainer.checkpoint import MANIFEST, CheckpointError, latest_valid_checkpoint, verify_checkpoint

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
        raise CheckpointError(f"{p} does not exist (expected a checkpoint, runs/<run>/checkpoints/step_N, or a run directory)")
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
        raise CheckpointError(f"{p} is a peft adapter directory, not a tether checkpoint; load it with "
                              "peft.AutoPeftModelForCausalLM and merge_and_unload() to get a plain model")
    if (p / "config.json").is_file():
        raise CheckpointError(f"{p} is a Hugging Face model directory (config.json), not a tether checkpoint: it "
                              "already loads with from_pretrained, there is nothing to export")
    raise CheckpointError(f"{p} is not a tether checkpoint (no actor/ or {MANIFEST}) nor a run directory (no checkpoints/)")


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path) -> Path:
    """Write a ``save_pretrained`` directory (safetensors, config, tokenizer) that
    ``AutoModelForCausalLM.from_pretrained`` loads. A LoRA checkpoint is merged into its base model.

    Args:
        checkpoint: a checkpoint directory, or a run directory (its latest checkpoint whose actor
            verifies; see :func:`resolve_checkpoint`).
        out_dir: must not exist or be empty: an export never deletes anything.

    Raises:
        CheckpointError: see :func:`resolve_checkpoint`; no actor weights; ``out_dir`` is a
            non-empty directory or a file.
    """
    ckpt = resolve_checkpoint(checkpoint)
    try:
        verify_checkpoint(ckpt)
    except CheckpointError as e:
        log.warning("export: %s; the actor's files verify, which is all an export reads", e)
    src = ckpt / "actor"
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"{out} already exists and is not an empty directory; choose a new OUT_DIR")
    if (src / "adapter_config.json").is_file():
        from peft import AutoPeftModelForCausalLM
        from transformers import AutoTokenizer

        model = AutoPeftModelForCausalLM.from_pretrained(str(src)).merge_and_unload()
        model.save_pretrained(out, safe_serialization=True)
        AutoTokenizer.from_pretrained(str(src)).save_pretrained(out)
        return out
    if not (src / "config.json").is_file():
        raise CheckpointError(f"checkpoint {ckpt}: file actor/config.json is missing")
    if not any(src.glob("*.safetensors")):
        raise CheckpointError(f"checkpoint {ckpt}: no actor/*.safetensors weights")
    out.mkdir(parents=True, exist_ok=True)
    for f in sorted(src.iterdir()):
        if f.is_file():
            shutil.copy2(f, out / f.name)
    return out
