"""``tether`` attention: transformers' ``sdpa`` attention, with a matmul path for low-precision CPU work.

On CPU, PyTorch's ``scaled_dot_product_attention`` runs its flash kernel in bf16 and fp16, and for
the short rows and one-token decode queries of RL post-training that kernel is slower than plain
matmuls (``benchmarks/bench_attention.py``, one core, bf16, GQA 4/2 heads, head_dim 64, as called from
transformers' ``sdpa_attention_forward``):

* decode, one query over 48 cached keys, 64 rows: flash 1.41 ms, matmuls 0.30 ms;
* forward + backward over 64 rows of 48 tokens: flash 34 ms, matmuls 5.6 ms; of 128 tokens (16
  rows): 25 against 8.5 ms; of 192 tokens the two trade places from run to run (31 against 23 ms,
  30 against 32); of 256, flash 49 against 55 ms; at 1024 tokens (16/4 heads of 128) flash wins by
  far (0.73 s against 1.85 s). docs/performance.md#attention-actorattn_implementation has the table.

:func:`tether_attention` takes the matmul path (:func:`matmul_attention`) when all of these hold
(:func:`use_matmul`): the tensors are on CPU; the work is low precision (bf16/fp16 tensors, or
float32 tensors under a bf16/fp16 ``torch.autocast``); no dropout, softcap, attention sinks or
position bias; and the query is one token or the keys number at most :data:`MAX_MATMUL_KEYS`, with
at most :data:`MAX_MATMUL_SCORES` scores per call (the matmul path materialises the
(B, H, L, S) float32 scores that flash never holds). Everything else, and all float32 and float64
work, is ``sdpa_attention_forward`` itself: the same call, bit for bit.

Selected by ``actor.attn_implementation`` (``auto`` picks ``tether`` for low-precision CPU runs):
:func:`set_attn_implementation`. Masks are built exactly as for ``sdpa`` (the name is registered
with ``sdpa_mask``), so padding, packed sequences and caches behave as they do there.
"""

from __future__ import annotations

import torch

from tether.config import ConfigError

NAME = "tether"
#: longest key sequence the matmul path takes for queries of more than one token (between 128 and 256
#: the two trade places from run to run; flash wins from 256 on).
MAX_MATMUL_KEYS = 128
#: most float32 scores (B · H · L · S) one call of the matmul path materialises: 2^24 (64 MiB).
MAX_MATMUL_SCORES = 1 << 24
_LOW = (torch.bfloat16, torch.float16)


def _compute_dtype(query: torch.Tensor) -> torch.dtype:
    """The dtype the attention matmuls run in: the autocast dtype on the query's device, else its own."""
    device = query.device.type
    if query.dtype in (torch.float32, *_LOW) and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return query.dtype


def use_matmul(module, query: torch.Tensor, key: torch.Tensor, attention_mask, dropout: float, kwargs: dict) -> bool:
    """Whether :func:`tether_attention` takes :func:`matmul_attention` for this call (see the module doc)."""
    B, H, L, _ = query.shape
    S = key.shape[2]
    if query.device.type != "cpu" or _compute_dtype(query) not in _LOW:
        return False
    if (
        dropout
        or kwargs.get("softcap") is not None
        or kwargs.get("s_aux") is not None
        or kwargs.get("position_bias") is not None
    ):
        return False
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        return False  # a float additive mask: only custom callers build one for sdpa
    if L > 1 and S > MAX_MATMUL_KEYS:
        return False
    return B * H * L * S <= MAX_MATMUL_SCORES


def matmul_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None,
    is_causal: bool,
) -> torch.Tensor:
    """softmax(q kᵀ · scale + mask) v with the scores and softmax in float32, GQA without copying keys.

    Args:
        query: (B, H, L, D); key, value: (B, H_kv, S, D), H a multiple of H_kv (query head h reads
            key/value head h // (H / H_kv), as transformers' ``repeat_kv``).
        attention_mask: boolean, broadcastable to (B, 1, L, S), True = attend (``sdpa_mask``'s), or
            None: causal when ``is_causal`` and L > 1 (top-left aligned, as sdpa's ``is_causal``; keys
            past L are dropped, as ``sdpa_attention_forward`` does), else every key.
        scaling: the score scale (None: D^-1/2).
        is_causal: the module's causality, used only when ``attention_mask`` is None.
    Returns:
        (B, L, H, D) contiguous, in the matmul dtype (``sdpa_attention_forward``'s layout). A query row
        that may attend to no key (left padding) gets uniform weights, a finite value nobody reads.
    """
    B, H, L, D = query.shape
    H_kv = key.shape[1]
    G = H // H_kv
    if attention_mask is None and is_causal and L > 1:
        key, value = key[:, :, :L], value[:, :, :L]
        attention_mask = torch.ones(L, L, dtype=torch.bool, device=query.device).tril()
    S = key.shape[2]
    dtype = _compute_dtype(query)
    q, k, v = query.to(dtype), key.to(dtype), value.to(dtype)
    q = q.reshape(B, H_kv, G * L, D)
    if L == 1:  # keys from a cache: k qᵀ reads their (S, D) rows in place, q kᵀ would copy kᵀ every step
        scores = torch.matmul(k, q.transpose(-1, -2)).transpose(-1, -2)  # (B, H_kv, G, S), a transposed view
    else:
        scores = torch.matmul(q, k.transpose(-1, -2))  # (B, H_kv, G·L, S)
    scores = scores.to(torch.float32 if dtype in _LOW else dtype, memory_format=torch.contiguous_format)
    scores = scores * (D**-0.5 if scaling is None else scaling)
    scores = scores.view(B, H_kv, G, L, S)
    if attention_mask is not None:  # (.., L, S) → (B|1, 1, 1, L, S) against the G query heads of a key head
        mask = attention_mask if attention_mask.dim() == 4 else attention_mask.view(1, 1, L, S)
        scores = scores.masked_fill(~mask.unsqueeze(2), torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1).to(dtype).view(B, H_kv, G * L, S)
    out = torch.matmul(probs, v)  # (B, H_kv, G·L, D)
    return out.view(B, H, L, D).transpose(1, 2).contiguous()


def tether_attention(
    module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, is_causal=None, **kwargs
):
    """A transformers attention function (``AttentionInterface``): :func:`matmul_attention` where
    :func:`use_matmul` says so, else ``sdpa_attention_forward`` with the same arguments."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if not use_matmul(module, query, key, attention_mask, dropout, kwargs):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    return matmul_attention(query, key, value, attention_mask, scaling, bool(causal)), None


def register() -> None:
    """Register :data:`NAME` with transformers' attention and mask interfaces (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, tether_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)


def resolve(setting: str, *, device: torch.device | str, dtypes: tuple[str | None, ...]) -> str | None:
    """The attention implementation ``actor.attn_implementation = setting`` gives, None = leave the model's.

    ``auto``: ``tether`` on CPU when any of ``dtypes`` (storage, compute, FSDP gather; None entries
    ignored) is bfloat16 or float16, else None (transformers' default, ``sdpa``); ``model``: None;
    any other name as given.
    """
    if setting == "auto":
        low = any(d in ("bfloat16", "float16") for d in dtypes)
        return NAME if torch.device(device).type == "cpu" and low else None
    return None if setting == "model" else setting


def set_attn_implementation(model, name: str | None, key: str = "actor.attn_implementation"):
    """``model`` with its attention implementation set to ``name`` (None: unchanged); returns ``model``.

    Raises:
        ConfigError: transformers refuses ``name`` for this model (unknown, or a kernel not installed),
            named with ``key``.
    """
    if name is None:
        return model

    if name == NAME:
        register()
    try:
        model.set_attn_implementation(name)
    except (ValueError, ImportError, KeyError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"{key}={name!r}: transformers refuses it for this model: {first}") from None
    return model


def for_config(cfg, device: torch.device | str) -> str | None:
    """:func:`resolve` for a config's ``actor.attn_implementation`` on ``device``, checked before any model loads.

    Raises:
        ConfigError: a name transformers does not know (not ``eager``, not registered with its
            ``AttentionInterface``, not a Hub kernel ``org/name``), naming the key and the known names.
    """
    name = resolve(
        cfg.actor.attn_implementation,
        device=device,
        dtypes=(cfg.actor.dtype, cfg.actor.compute_dtype, cfg.trainer.fsdp.param_dtype),
    )
    if name is None or name == NAME or "/" in name:
        return name
    from transformers import AttentionInterface

    known = ["eager", *AttentionInterface._global_mapping]
    if name not in known:
        raise ConfigError(
            f"actor.attn_implementation={name!r} is not an attention implementation transformers knows; use auto, "
            f"model, {NAME} or one of {sorted(known)}"
        )
    return name
