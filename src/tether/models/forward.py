"""Log-probs and entropy of response tokens from a causal LM's forward pass, under autocast, with the LM head's
precision patch."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from tether.algos import logprobs_and_entropy_from_logits
from tether.models.loading import DTYPES
from tether.models.vocab_parallel import logprobs_and_entropy as vocab_parallel_logprobs_and_entropy


def autocast(device: torch.device | str, compute_dtype: str = "float32"):
    """``torch.autocast`` to ``compute_dtype`` on ``device`` (``actor.compute_dtype``), or a no-op for float32.

    Under bfloat16 the matmuls run in bf16 while parameters, their gradients and the optimizer stay
    in the parameter dtype (fp32 master weights); the LM head stays fp32 (:func:`patch_lm_head`,
    ``actor.lm_head_fp32``), and
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
        :mod:`tether.models.vocab_parallel`'s.
        Position t scores token P+t from the logits at P+t-1, with logits divided by ``temperature``.
    """
    kwargs = {}
    if "logits_to_keep" in _forward_params(model):
        kwargs["logits_to_keep"] = response_len
    # (B, P+T-1): the last token is only scored. Contiguous: a strided view made the forward 4-10% slower
    # (bench_last_position.py)
    ids_in, mask_in = input_ids[:, :-1].contiguous(), attention_mask[:, :-1].contiguous()
    with autocast(input_ids.device, compute_dtype):
        out = model(
            input_ids=ids_in,
            attention_mask=mask_in,
            position_ids=position_ids_from_mask(mask_in),
            use_cache=False,
            **kwargs,
        )
    logits = out.logits[:, -response_len:, :]  # (B, T, V): position P-1+t scores response token t
    ids = input_ids[:, -response_len:]
    if type(logits).__name__ == "DTensor":  # tensor parallelism: (B, T, V / tp) shards, never gathered
        logprobs, entropy = vocab_parallel_logprobs_and_entropy(logits, ids, temperature, with_entropy=with_entropy)
    else:
        logprobs, entropy = logprobs_and_entropy_from_logits(logits, ids, temperature, with_entropy=with_entropy)
    return logprobs, entropy, (logits if return_logits else None)
