"""Loading Hugging Face models, tokenizers and LoRA adapters from local directories (nothing is downloaded)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from tether.config import EMBEDDED, ConfigError
from tether.tasks import embedded_reference

log = logging.getLogger("tether")

try:
    from safetensors import SafetensorError
except ImportError:  # pragma: no cover - safetensors is a dependency
    SafetensorError = OSError
_LOAD_ERRORS = (OSError, ValueError, RuntimeError, SafetensorError)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_model_path(name: str, key: str = "actor.model", *, task: str = "digitsum") -> Path:
    """A local model directory for ``name``; 'embedded' is the reference of the embedded task ``task``
    (``data.embedded_task``: :func:`tether.tasks.embedded_reference`; the digit-sum reference is built if missing).

    Raises:
        ConfigError: the directory does not exist or holds no config.json (names ``key``). Nothing
            is ever downloaded: hub ids are not accepted.
    """
    if name == EMBEDDED:
        return embedded_reference(task)
    p = Path(name).expanduser()
    if p.is_file():
        raise ConfigError(
            f"{key}={name!r} is a file, not a model directory: give the Hugging Face model directory (the one holding "
            "config.json and the weights)"
        )
    if not p.is_dir():
        raise ConfigError(f"{key}={name!r}: no such local model directory (tether never downloads models)")
    if not (p / "config.json").is_file():
        hint = (
            "; a tether run or checkpoint directory becomes one with tether export"
            if (p / "checkpoints").is_dir() or (p / "MANIFEST.json").is_file()
            else ""
        )
        raise ConfigError(f"{key}={name!r}: {p} holds no config.json; is it a Hugging Face model directory?{hint}")
    return p


def load_tokenizer(path: Path, *, trust_remote_code: bool = False, key: str = "actor.model"):
    """AutoTokenizer from ``path``, left-padding for generation, with a pad token.

    A tokenizer without a pad token gets its EOS token as pad (as TRL and verl do), with a warning.

    Raises:
        ConfigError: no tokenizer files in ``path``, or neither a pad nor an EOS token.
    """
    from transformers import AutoTokenizer

    tokenizer_files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")
    if not any((Path(path) / f).is_file() for f in tokenizer_files):
        raise ConfigError(
            f"{key}: {path} holds no tokenizer files ({', '.join(tokenizer_files[:3])}, ...); save the tokenizer next "
            "to the model"
        )
    try:
        tok = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    except Exception as e:  # transformers raises OSError/ValueError/TypeError depending on what is missing
        raise ConfigError(f"{key}: cannot load a tokenizer from {path}: {type(e).__name__}: {e}") from None
    if tok.eos_token_id is None:
        raise ConfigError(f"{key}: the tokenizer in {path} has no EOS token; responses could never end")
    if tok.pad_token_id is None:
        log.warning("%s: the tokenizer in %s has no pad token; using its EOS token %r as pad", key, path, tok.eos_token)
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def load_causal_lm(path: Path, *, dtype: str = "float32", trust_remote_code: bool = False):
    """AutoModelForCausalLM from a local directory (safetensors preferred), in ``dtype``."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=DTYPES[dtype], trust_remote_code=trust_remote_code)
    except _LOAD_ERRORS as e:  # no weights, a truncated file, an unknown architecture
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ConfigError(f"cannot load a causal LM from {path}: {type(e).__name__}: {first}") from None


def apply_lora(model, lora):
    """``model`` with peft LoRA adapters from an ``actor.lora`` section (rank, alpha, dropout, target_modules)."""
    from peft import LoraConfig, get_peft_model

    target = lora.target_modules if isinstance(lora.target_modules, str) else list(lora.target_modules)
    return get_peft_model(
        model,
        LoraConfig(
            r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=target, task_type="CAUSAL_LM"
        ),
    )
