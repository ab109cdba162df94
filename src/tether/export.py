"""``tether export CHECKPOINT OUT_DIR``: a checkpoint's actor as a Hugging Face model directory."""

from __future__ import annotations

import shutil
from pathlib import Path

from tether.trainer.checkpoint import CheckpointError, verify_checkpoint


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path) -> Path:
    """Write a ``save_pretrained`` directory (safetensors, config, tokenizer) that
    ``AutoModelForCausalLM.from_pretrained`` loads. A LoRA checkpoint is merged into its base model.

    Raises:
        CheckpointError: the checkpoint is incomplete or corrupt (naming the file).
    """
    ckpt = Path(checkpoint)
    verify_checkpoint(ckpt)
    src = ckpt / "actor"
    out = Path(out_dir)
    if (src / "adapter_config.json").is_file():
        from peft import AutoPeftModelForCausalLM
        from transformers import AutoTokenizer

        model = AutoPeftModelForCausalLM.from_pretrained(str(src)).merge_and_unload()
        model.save_pretrained(out, safe_serialization=True)
        AutoTokenizer.from_pretrained(str(src)).save_pretrained(out)
        return out
    if not (src / "config.json").is_file():
        raise CheckpointError(f"checkpoint {ckpt}: actor/config.json is missing")
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(src, out)
    return out
