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
    if (ckpt / "dcp").is_dir() and not (src / "adapter_config.json").is_file():
        return _export_sharded(ckpt, out)
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


def _export_sharded(ckpt: Path, out: Path) -> Path:
    """A trainer.backend=ray checkpoint: :func:`load_sharded_actor`, then ``save_pretrained``."""
    from transformers import AutoTokenizer

    model = load_sharded_actor(ckpt)
    model.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(str(ckpt / "actor")).save_pretrained(out)
    return out


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
