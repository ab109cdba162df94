"""The files a local role writes into a checkpoint directory and reads back (``tether.checkpoint``'s layout)."""

from __future__ import annotations

import contextlib
from pathlib import Path

from safetensors.torch import load_file, load_model, save_file, save_model

from tether.checkpoint import CheckpointError


def save_policy(model, tokenizer, out: Path) -> None:
    """A policy as a ``save_pretrained`` directory (a LoRA policy: its adapters) with its tokenizer."""
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def load_policy(model, directory: Path, checkpoint: Path) -> None:
    """Weights of :func:`save_policy`'s directory into ``model`` (a LoRA policy: its adapters; tied weights may be
    absent).

    Raises:
        CheckpointError: naming the checkpoint, for a missing file or weights that do not match the model.
    """
    if hasattr(model, "peft_config"):
        from peft import set_peft_model_state_dict

        files = sorted(directory.glob("adapter_model.safetensors"))
        if not files:
            full = (
                " (it holds a full model: it was saved without actor.lora; resume it with actor.lora.rank=0)"
                if any(directory.glob("model*.safetensors"))
                else ""
            )
            raise CheckpointError(f"checkpoint {checkpoint}: actor/adapter_model.safetensors is missing{full}")
        set_peft_model_state_dict(model, load_file(str(files[0])))
        return
    state = {}
    for f in sorted(directory.glob("*.safetensors")):
        state.update(load_file(str(f)))
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not _is_tied(model, k)]
    if any("lora_" in k for k in unexpected) or (directory / "adapter_config.json").is_file():
        raise CheckpointError(
            f"checkpoint {checkpoint}: actor/ holds LoRA adapters (saved with actor.lora.rank > 0), not a full model: "
            "resume it with its actor.lora settings"
        )
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint {checkpoint}: actor weights do not match the model (missing {missing[:3]}, unexpected "
            f"{unexpected[:3]})"
        )


def save_module(model, path: Path, *, shared_tensors: bool = False) -> None:
    """A module's state dict as one safetensors file: every tensor (the critic's), or with ``shared_tensors`` each
    shared tensor once (``safetensors.torch.save_model``: the reference's under ``ref.reset_every``)."""
    if shared_tensors:
        save_model(model, str(path))
    else:
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))


def load_module(model, path: Path, why: str, *, shared_tensors: bool = False) -> None:
    """:func:`save_module`'s file into ``model``.

    Raises:
        CheckpointError: the file is missing (``why`` says when it is written).
    """
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path.parent}: {path.name} is missing ({why})")
    if shared_tensors:
        load_model(model, str(path))
    else:
        model.load_state_dict(load_file(str(path)))


def keep_lrs(optimizer):
    """A context that restores ``optimizer``'s learning rates on exit (a rollback keeps the current ones)."""

    @contextlib.contextmanager
    def kept():
        lrs = [g["lr"] for g in optimizer.param_groups]
        yield
        for g, lr in zip(optimizer.param_groups, lrs, strict=True):
            g["lr"] = lr

    return kept()


def _is_tied(model, key: str) -> bool:
    tied = getattr(model, "_tied_weights_keys", None) or []
    if isinstance(tied, dict):
        tied = list(tied.keys())
    return key in tied or key.endswith("lm_head.weight")
