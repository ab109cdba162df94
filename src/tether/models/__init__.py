"""Loading Hugging Face models and tokenizers, the critic's value head, and log-probs from a forward pass."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import torch
from torch import nn

from tether.algos import logprobs_and_entropy_from_logits
from tether.config import EMBEDDED, ConfigError

log = logging.getLogger("tether")

try:
    from safetensors import SafetensorError
except ImportError:  # pragma: no cover - safetensors is a dependency
    SafetensorError = OSError
_LOAD_ERRORS = (OSError, ValueError, RuntimeError, SafetensorError)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_model_path(name: str, key: str = "actor.model") -> Path:
    """A local model directory for ``name``; 'embedded' is the shipped digit-sum reference (built if missing).

    Raises:
        ConfigError: the directory does not exist or holds no config.json (names ``key``). Nothing
            is ever downloaded: hub ids are not accepted.
    """
    if name == EMBEDDED:
        from tether.tasks.sft import ensure_reference

        return Path(ensure_reference())
    p = Path(name).expanduser()
    if p.is_file():
        raise ConfigError(f"{key}={name!r} is a file, not a model directory: give the Hugging Face model directory "
                          "(the one holding config.json and the weights)")
    if not p.is_dir():
        raise ConfigError(f"{key}={name!r}: no such local model directory (tether never downloads models)")
    if not (p / "config.json").is_file():
        raise ConfigError(f"{key}={name!r}: {p} holds no config.json; is it a Hugging Face model directory?")
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
        raise ConfigError(f"{key}: {path} holds no tokenizer files ({', '.join(tokenizer_files[:3])}, ...); save the tokenizer next to the model")
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
    return get_peft_model(model, LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=target, task_type="CAUSAL_LM"))


def autocast(device: torch.device | str, compute_dtype: str = "float32"):
    """``torch.autocast`` to ``compute_dtype`` on ``device`` (``actor.compute_dtype``), or a no-op for float32.

    Under bfloat16 the matmuls run in bf16 while parameters, their gradients and the optimizer stay
    in the parameter dtype (fp32 master weights); the LM head stays fp32 (:func:`patch_lm_head`, ``actor.lm_head_fp32``), and
    log-softmax, entropy, KL and the losses are computed in fp32 from fp32 logits.
    """
    device_type = torch.device(device).type
    if compute_dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=DTYPES[compute_dtype])


def patch_lm_head(model: nn.Module, *, fp32: bool = False) -> nn.Module:
    """Patch the LM head's forward (an instance attribute; ``head._tether_patch`` records the flags):
    its input is made contiguous, and with ``fp32`` it runs in fp32 outside autocast (its input cast
    to fp32), so logits, and the log-probs and KL computed from them, carry fp32 precision under
    ``actor.compute_dtype=bfloat16`` (``actor.lm_head_fp32``; TRL's ``cast_lm_head_to_fp32``).

    Contiguous: Hugging Face's causal LMs apply the head to ``hidden[:, -logits_to_keep:]``, a strided
    view, and torch's matmul folds such an input into one mm or runs a bmm depending on whether the
    head's weight requires grad; for a micro-batch of a few rows the two round differently, so the
    actor (weights requiring grad) and the frozen reference disagreed by ~2e-7 nats at equal weights
    (a token budget's 3-row micro-batch, found by a new-user trial). A contiguous input takes the
    same mm in both. Idempotent for the same flags (other flags replace the patch); returns ``model``.
    """
    head = model.get_output_embeddings()
    if head is None:
        return model
    flags = {"fp32": fp32}
    if getattr(head, "_tether_patch", None) == flags:
        return model
    unpatch_lm_head(model)
    inner = head.forward

    if fp32:

        def forward(x, *args, **kwargs):
            with torch.autocast(x.device.type, enabled=False):
                return inner(x.to(head.weight.dtype).contiguous(), *args, **kwargs)

    else:

        def forward(x, *args, **kwargs):
            return inner(x.contiguous(), *args, **kwargs)

    head.forward = forward
    head._tether_patch = flags
    return model


def unpatch_lm_head(model: nn.Module) -> dict | None:
    """Remove :func:`patch_lm_head`'s patch from ``model``'s head (a copy's patch still runs the
    original's head: its closure holds it); returns the flags it had, or None when unpatched."""
    head = model.get_output_embeddings()
    flags = getattr(head, "_tether_patch", None) if head is not None else None
    if flags is not None:
        del head.forward, head._tether_patch  # the instance attributes the patch set
    return flags


def fp32_lm_head(model: nn.Module) -> nn.Module:
    """:func:`patch_lm_head` with ``fp32=True``."""
    return patch_lm_head(model, fp32=True)


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, L) positions that skip left padding, exactly as ``generate`` computes them."""
    pos = attention_mask.long().cumsum(-1) - 1
    return pos.masked_fill(attention_mask == 0, 0)


def _forward_params(model: nn.Module) -> set[str]:
    """Keyword names of the causal LM's ``forward`` (a PEFT wrapper's base model; cached per module)."""
    import inspect

    cached = getattr(model, "_tether_forward_params", None)
    if cached is not None:
        return cached
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = set(inspect.signature(base.forward).parameters)
    try:
        model._tether_forward_params = names
    except (AttributeError, TypeError):  # pragma: no cover - a module that refuses attributes
        pass
    return names


def response_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_len: int,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    return_logits: bool = False,
    compute_dtype: str = "float32",
):
    """Log-probs of the response tokens under ``model``.

    The last column is never fed: its logits would predict a token after the response, and causal
    attention makes every other position's output independent of it, so the model runs on P+T-1
    positions (issue 13). The LM head runs only on the T positions that score a response token
    (``logits_to_keep``, where the model's forward accepts it, as Hugging Face's
    Llama/Qwen2/Mistral/Gemma do; else on every position), so prompt positions cost no (P, V)
    logits; the log-softmax and entropy stay chunked (:func:`tether.algos.logprobs_and_entropy_from_logits`).

    Args:
        input_ids, attention_mask: (B, P+T), prompt left-padded then response right-padded.
        response_len: T.
        compute_dtype: the model forward runs under :func:`autocast` to this dtype; log-probs and entropy
            are computed in fp32 either way.
    Returns:
        (logprobs (B, T) nats, entropy (B, T) nats or None, logits (B, T, V) / temperature-free or None).
        Under tensor parallelism the logits are a DTensor sharded on V and the log-softmax is
        :mod:`tether.distributed.vocab_parallel`'s.
        Position t scores token P+t from the logits at P+t-1, with logits divided by ``temperature``.
    """
    kwargs = {}
    if "logits_to_keep" in _forward_params(model):
        kwargs["logits_to_keep"] = response_len
    # (B, P+T-1): the last token is only scored. Contiguous: a strided view made the forward 4-10% slower (bench_last_position.py)
    ids_in, mask_in = input_ids[:, :-1].contiguous(), attention_mask[:, :-1].contiguous()
    with autocast(input_ids.device, compute_dtype):
        out = model(input_ids=ids_in, attention_mask=mask_in, position_ids=position_ids_from_mask(mask_in), use_cache=False, **kwargs)
    logits = out.logits[:, -response_len:, :]  # (B, T, V): position P-1+t scores response token t
    ids = input_ids[:, -response_len:]
    if type(logits).__name__ == "DTensor":  # tensor parallelism: (B, T, V / tp) shards, never gathered
        from tether.distributed.vocab_parallel import logprobs_and_entropy

        logprobs, entropy = logprobs_and_entropy(logits, ids, temperature, with_entropy=with_entropy)
    else:
        logprobs, entropy = logprobs_and_entropy_from_logits(logits, ids, temperature, with_entropy=with_entropy)
    return logprobs, entropy, (logits if return_logits else None)


class ValueModel(nn.Module):
    """Critic: a causal-LM backbone (``AutoModel``) with a scalar value head.

    ``forward`` returns V(s_t) for the response: (B, T), the value of the state before each response
    token (the hidden state at position P+t-1), in reward units. The state after the last token is
    terminal (GAE takes its value as 0), so the last token is never fed.
    """

    def __init__(self, backbone: nn.Module, hidden_size: int):
        super().__init__()
        self.backbone = backbone
        self.value_head = self.make_head(hidden_size)

    @staticmethod
    def make_head(hidden_size: int) -> nn.Linear:
        """The zero-initialised value head. nn.Linear's own initialisation draws from torch's global
        RNG before it is zeroed, so building the head advances that RNG (the Ray backend's driver,
        which holds no critic, builds one head too and samples as the local backend does)."""
        head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(head.weight)
        nn.init.zeros_(head.bias)
        return head

    @classmethod
    def from_pretrained(cls, path: Path, *, dtype: str = "float32", trust_remote_code: bool = False) -> ValueModel:
        from transformers import AutoModel

        try:
            backbone = AutoModel.from_pretrained(str(path), dtype=DTYPES[dtype], trust_remote_code=trust_remote_code)
        except _LOAD_ERRORS as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise ConfigError(f"cannot load the critic backbone from {path}: {type(e).__name__}: {first}") from None
        return cls(backbone, backbone.config.hidden_size).to(DTYPES[dtype])

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, response_len: int, *,
        position_ids: torch.Tensor | None = None, keep: torch.Tensor | None = None, shared=None,
    ) -> torch.Tensor:  # fmt: skip
        """(B, T) V(s_t); or, with ``keep`` (packed (R, L) rows of ``tether.workers.packing.PackedLayout``:
        no attention mask, ``position_ids`` restarting per sequence), (N,) V at the N ``keep`` positions; or, with
        ``shared`` (actor.share_prompt_prefix: (prompt_ids, prompt_mask, response_ids, response_mask, groups)), (B, T)
        V(s_t) with each distinct prompt run once (``tether.workers.prefix.shared_prefix_values``)."""
        if shared is not None:
            from tether.workers.prefix import shared_prefix_values

            return shared_prefix_values(self.backbone, self.value_head, *shared)
        if keep is not None:
            out = self.backbone(input_ids=input_ids, attention_mask=None, position_ids=position_ids, use_cache=False)
            return self.value_head(out.last_hidden_state[keep]).squeeze(-1).float()  # (N,)
        ids_in, mask_in = input_ids[:, :-1].contiguous(), attention_mask[:, :-1].contiguous()  # (B, P+T-1): V after the last token is unused
        out = self.backbone(input_ids=ids_in, attention_mask=mask_in, position_ids=position_ids_from_mask(mask_in), use_cache=False)
        hidden = out.last_hidden_state[:, -response_len:, :]  # (B, T, H)
        return self.value_head(hidden).squeeze(-1).float()  # (B, T)
