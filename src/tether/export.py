"""``tether export CHECKPOINT OUT_DIR``: a checkpoint's actor as a Hugging Face model directory."""

from __future__ import annotations

import shutil
from pathlib import Path

from tether.trainer.checkpoint import CheckpointError, verify_checkpoint


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path) -> Path:
    """Write a ``save_pretrained`` directory (safetensors, config, tokenizer) that
    ``AutoModelForCausalLM.from_pretrained`` loads. A LoRA checkpoint is merged into its base model.

    The checkpoint is verified first (sizes and sha256 of its MANIFEST). ``out_dir`` must not exist
    or be empty: an export never deletes anything.

    Raises:
        CheckpointError: the checkpoint is incomplete or corrupt (naming the file), has no actor
            weights, or ``out_dir`` is a non-empty directory or a file.
    """
    ckpt = Path(checkpoint)
    verify_checkpoint(ckpt)
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
