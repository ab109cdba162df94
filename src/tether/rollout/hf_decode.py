"""tether's own decode loop for Hugging Face causal LMs (``rollout.hf_decode=tether``), exact to ``generate``.

Two parts, each usable alone:

* :class:`PreallocatedCache`: a transformers ``Cache`` whose per-layer key/value buffers are allocated
  once, at capacity (prompt length + max new tokens), and written in place; ``update`` returns views
  of the filled part, so attention runs over exactly the tokens ``DynamicCache`` would hold and no
  decode step copies the cache (``DynamicCache`` concatenates, copying every layer's keys and values at
  every step; on short prompts that copy is cheap, see docs/performance.md#hf-decode-loop). Unlike
  ``cache_implementation="static"`` it never attends over the empty tail of the buffer.
* :func:`decode`: prefill, then one ``model(input_ids=<last token>, position_ids, attention_mask,
  cache)`` per step → ``generate``'s own logits processors (built by ``generate``'s own
  ``_get_logits_processor`` from the resolved generation config, so the model's
  ``generation_config.json`` extras apply as in ``generate``) → ``torch.multinomial`` (or ``argmax``
  when greedy) → pad after EOS. Every forward gets the same arguments ``generate`` passes
  (transformers 5: position ids from the attention mask's cumulative sum, the 2-D mask dropped when
  it is all ones, ``logits_to_keep=1``), the logits are copied to float32 as ``generate`` does, and
  sampling draws the same random numbers in the same order, so for a fixed seed the tokens are
  bitwise those of ``generate`` with a ``DynamicCache`` (tests/trainer/test_hf_decode.py).

:func:`plan` says whether a call can take this path; the engine falls back to ``model.generate`` for
everything else: beam search and other generation modes, ``num_return_sequences`` > 1, stop strings,
``max_time``, custom stopping criteria, a cache passed in, ``cache_implementation``, ``return_dict_in_generate``
and score outputs, any keyword outside :data:`SUPPORTED_KEYS`, encoder-decoder models, models whose
default cache is not plain full-attention ``DynamicLayer`` layers (sliding-window, linear attention,
hybrid), and a transformers version without the private ``generate`` helpers used here.
"""

from __future__ import annotations

import inspect

import torch
from transformers.cache_utils import Cache, DynamicLayer  # this module is imported lazily (tether.rollout.hf)

#: attention implementations that take ``sdpa_mask``'s boolean masks and cast keys to the autocast
#: dtype themselves (transformers' ``sdpa``; ``tether``'s, :mod:`tether.models.attention`)
SDPA_MASK_ATTENTION = ("sdpa", "tether")

#: ``generate`` keywords the loop handles (anything else: ``model.generate``).
SUPPORTED_KEYS = frozenset(
    {
        "do_sample",
        "temperature",
        "top_p",
        "top_k",
        "max_new_tokens",
        "suppress_tokens",
        "logits_processor",
        "min_new_tokens",
        "repetition_penalty",
        "pad_token_id",
        "eos_token_id",
        "use_cache",
    }
)


class PreallocatedLayer(DynamicLayer):
    """One layer's keys and values, (B, H_kv, capacity, D) each, filled from position 0 on.

    ``update`` writes the new (B, H_kv, n, D) states at ``[filled, filled + n)`` and returns the views
    ``[:, :, :filled + n]``: the same values ``DynamicLayer`` would return by concatenation, without a copy.
    ``dtype``: the buffers' dtype (None: the states' own). Under a bf16 autocast :func:`decode` stores
    bf16: rotary embeddings leave the keys float32 there, and attention casts every cached key to bf16
    at every step; cast once on writing, the values attention sees are the same, bit for bit.

    Raises:
        ValueError: an update past ``capacity`` (the caller sized the cache too small).
    """

    def __init__(self, capacity: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.capacity = capacity
        self.dtype = dtype
        self.filled = 0
        self.key_buf: torch.Tensor | None = None  # (B, H_kv, capacity, D)
        self.value_buf: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        B, H, _, D = key_states.shape
        self.device = key_states.device
        self.key_buf = key_states.new_empty(B, H, self.capacity, D, dtype=self.dtype or key_states.dtype)
        self.value_buf = value_states.new_empty(
            B, value_states.shape[1], self.capacity, value_states.shape[-1], dtype=self.dtype or value_states.dtype
        )
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, end = self.filled, self.filled + key_states.shape[-2]
        if end > self.capacity:
            raise ValueError(f"PreallocatedCache: {end} positions do not fit its capacity of {self.capacity}")
        self.key_buf[:, :, start:end] = key_states
        self.value_buf[:, :, start:end] = value_states
        self.filled = end
        self.keys, self.values = self.key_buf[:, :, :end], self.value_buf[:, :, :end]  # views, no copy
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.filled

    def get_max_length(self) -> int:
        return self.capacity

    def _reindex(self, indices: torch.Tensor) -> None:
        """Rows ``indices`` (a (B',) index) of the filled part, into fresh buffers at full capacity."""
        if not self.is_initialized:
            return
        for name in ("key_buf", "value_buf"):
            old = getattr(self, name)
            new = old.new_empty(len(indices), old.shape[1], self.capacity, old.shape[-1])
            new[:, :, : self.filled] = old[indices, :, : self.filled]
            setattr(self, name, new)
        self.keys, self.values = self.key_buf[:, :, : self.filled], self.value_buf[:, :, : self.filled]

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._reindex(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self._reindex(torch.arange(self.key_buf.shape[0], device=self.key_buf.device).repeat_interleave(repeats))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._reindex(beam_idx)

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of positions to drop, got {tokens_to_remove}")
        self.filled = max(0, self.filled + tokens_to_remove)
        if self.is_initialized:
            self.keys, self.values = self.key_buf[:, :, : self.filled], self.value_buf[:, :, : self.filled]

    def reset(self) -> None:
        self.filled = 0
        self.key_buf = self.value_buf = self.keys = self.values = None
        self.is_initialized = False


class PreallocatedCache(Cache):
    """A ``Cache`` of ``num_layers`` :class:`PreallocatedLayer` layers of ``capacity`` positions each (in ``dtype``)."""

    def __init__(self, num_layers: int, capacity: int, dtype: torch.dtype | None = None):
        super().__init__(layers=[PreallocatedLayer(capacity, dtype) for _ in range(num_layers)])


def preallocated_cache(model, capacity: int, dtype: torch.dtype | None = None) -> PreallocatedCache | None:
    """A :class:`PreallocatedCache` for ``model`` holding ``capacity`` positions per layer (in ``dtype``;
    None: the states' own), or None when the model's default cache is not plain full-attention
    ``DynamicLayer`` layers."""
    from transformers.cache_utils import DynamicCache

    config = model.config.get_text_config(decoder=True)
    try:
        default = DynamicCache(config=config)
    except Exception:  # an architecture transformers builds its cache for differently
        return None
    if not default.layers or any(type(layer) is not DynamicLayer for layer in default.layers):
        return None
    return PreallocatedCache(len(default.layers), capacity, dtype)


def cache_dtype(model, device: torch.device) -> torch.dtype | None:
    """The dtype :func:`decode` stores keys and values in: the autocast dtype when a bf16/fp16 autocast
    is on for ``device`` and the model's attention (``sdpa``, ``tether``) runs under it (it casts keys and
    values to that dtype itself), else None (the states' own dtype)."""
    if not torch.is_autocast_enabled(device.type):
        return None
    dtype = torch.get_autocast_dtype(device.type)
    attn = getattr(model.config, "_attn_implementation", None)
    return dtype if dtype in (torch.bfloat16, torch.float16) and attn in SDPA_MASK_ATTENTION else None


def cache_keyword(model) -> str | None:
    """The model forward's cache argument: ``cache`` (transformers 5) or ``past_key_values``; None if neither."""
    params = inspect.signature(model.forward).parameters
    return next((k for k in ("cache", "past_key_values") if k in params), None)


def plan(model, kwargs: dict):
    """The resolved ``GenerationConfig`` (a private copy) when :func:`decode` can serve this ``generate``
    call exactly, else None (the caller uses ``model.generate``). ``kwargs``: the ``generate`` keywords."""
    if (
        set(kwargs) - SUPPORTED_KEYS
        or getattr(model.config, "is_encoder_decoder", False)
        or not kwargs.get("use_cache", True)
    ):
        return None
    if not all(
        hasattr(model, f) for f in ("_prepare_generation_config", "_prepare_special_tokens", "_get_logits_processor")
    ):
        return None
    if cache_keyword(model) is None or "position_ids" not in inspect.signature(model.forward).parameters:
        return None
    from transformers.generation.configuration_utils import GenerationMode

    gen_kwargs = {k: v for k, v in kwargs.items() if k != "logits_processor"}
    try:
        config, model_kwargs = model._prepare_generation_config(None, **gen_kwargs)
    except Exception:
        return None
    if model_kwargs or config.get_generation_mode() not in (GenerationMode.SAMPLE, GenerationMode.GREEDY_SEARCH):
        return None
    unsupported = (
        (config.num_return_sequences or 1) > 1,
        config.stop_strings is not None,
        config.max_time is not None,
        config.cache_implementation is not None,
        bool(config.return_dict_in_generate),
        config.max_new_tokens is None,
        config.guidance_scale not in (None, 1),
        config.prefill_chunk_size is not None,
    )
    return None if any(unsupported) else config


def decode(
    model,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    config,
    *,
    logits_processor=None,
    prefill=None,
    drop_finished: bool = False,
    min_rows: int = 8,
    sampler: str = "multinomial",
) -> torch.Tensor:
    """Sample (or greedily decode) one response per row, token for token as ``model.generate``.

    Args:
        model: a Hugging Face causal LM (eval mode; the caller sets grad mode and autocast).
        prompt_ids, prompt_mask: (B, P) left-padded prompts and their attention mask (1 = token).
        config: the resolved generation config from :func:`plan` (a private copy: special tokens are
            written into it).
        logits_processor: user processors, run where ``generate`` runs them (after its own, before the
            temperature/top-k/top-p warpers), e.g. :class:`tether.rollout.hf.SampledLogprobs`.
        prefill: ``fn(cache) -> bool``, given a fresh, empty cache from :func:`preallocated_cache`: fills it
            with the first P - 1 prompt positions of all B rows and returns True (``rollout.share_prefill``:
            :meth:`tether.rollout.hf.HFRolloutEngine._shared_prefill`), or leaves it empty and returns
            False; None or False: all P positions are prefilled here, as ``generate`` does.
        drop_finished: stop running the model on rows that have ended (EOS), keeping at least
            ``min_rows`` (:func:`_compact`; ignored unless the model runs ``sdpa`` attention, transformers'
            default, or ``tether``'s); their tokens are the pad token either way, and sampling still
            draws for all B rows, so the other rows' tokens do not change. Their log-probs after EOS (the
            recorder's) are then computed from zero logits: meaningless, as after EOS anyway.
        sampler: ``"multinomial"`` (``generate``'s ``torch.multinomial``: one exponential draw per vocabulary
            entry and row) or ``"inverse_cdf"`` (:func:`sample_inverse_cdf`: one uniform per row; the
            same distribution, another random stream, so other tokens than ``generate``'s).
    Returns:
        (B, P + T) long: the prompts followed by T ≤ ``max_new_tokens`` new tokens, the pad token after
        each row's EOS (``generate``'s output).
    """
    device = prompt_ids.device
    B, P = prompt_ids.shape
    max_new = int(config.max_new_tokens)
    model._prepare_special_tokens(config, True, device=device)
    eos, pad = config._eos_token_tensor, config._pad_token_tensor
    mask = None if bool((prompt_mask == 1).all()) else prompt_mask  # generate drops an all-ones mask
    position_ids = (prompt_mask.long().cumsum(-1) - 1).masked_fill(prompt_mask == 0, 0)  # (B, P), as generate
    config.max_length = P + max_new
    if config.min_new_tokens is not None:
        config.min_length = config.min_new_tokens + P
    from transformers import LogitsProcessorList

    processors = model._get_logits_processor(
        generation_config=config,
        input_ids_seq_length=P,
        encoder_input_ids=prompt_ids,
        prefix_allowed_tokens_fn=None,
        logits_processor=LogitsProcessorList(logits_processor or []),
        device=device,
        model_kwargs={"attention_mask": mask},
    )
    cache = preallocated_cache(model, P + max_new, cache_dtype(model, device))
    if cache is None:
        raise ValueError(
            "decode: the model's cache is not plain full-attention DynamicLayer layers; use model.generate"
        )
    cache_kw = cache_keyword(model)
    # as generate
    keep = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    # the boolean 4-D mask of dropped-row batches is sdpa's mask type (eager attention adds float masks)
    drop_finished = drop_finished and getattr(model.config, "_attn_implementation", None) in SDPA_MASK_ATTENTION
    ids = prompt_ids.new_empty(B, P + max_new)  # (B, P + max_new) generate's input_ids, filled in place
    ids[:, :P] = prompt_ids
    full_mask = None
    if mask is not None:
        full_mask = prompt_mask.new_ones(B, P + max_new)  # (B, P + max_new) the 2-D mask generate grows by cat
        full_mask[:, :P] = prompt_mask
    if prefill is not None and prefill(cache):
        step_ids, step_pos, seen = prompt_ids[:, -1:], position_ids[:, -1:], P - 1
    else:
        step_ids, step_pos, seen = prompt_ids, position_ids, 0
    unfinished = torch.ones(B, dtype=torch.long, device=device)
    last_pos = position_ids[:, -1:]  # (B, 1)
    rows = None  # (A,) the rows the model still steps, in cache order; None = all B
    n = 0
    while n < max_new:
        length = seen + step_ids.shape[1]
        kwargs = {cache_kw: cache, "position_ids": step_pos, "use_cache": True, "return_dict": True, **keep}
        if full_mask is not None:
            # generate's 2-D mask; once rows are dropped, the (A, 1, 1, L) boolean mask transformers builds
            # from it for one query position: an all-ones 2-D mask of the rows left would be skipped, and
            # attention would take another kernel than in the full batch
            kwargs["attention_mask"] = (
                full_mask[:, :length] if rows is None else full_mask[rows, None, None, :length].bool()
            )
        out = model(input_ids=step_ids.clone(memory_format=torch.contiguous_format), **kwargs)
        logits = out.logits[:, -1].to(copy=True, dtype=torch.float32, device=device)  # (A, V)
        del out
        if rows is not None:  # the dropped rows' scores are never used: zeros keep every processor well defined
            logits = logits.new_zeros(B, logits.shape[-1]).index_copy_(0, rows, logits)  # (B, V)
        scores = _apply(processors, ids[:, : P + n], logits)
        if config.do_sample and sampler == "inverse_cdf":
            next_tokens = sample_inverse_cdf(torch.nn.functional.softmax(scores, dim=-1))
        elif config.do_sample:  # over all B rows, as generate: the same random numbers for every row
            next_tokens = torch.multinomial(torch.nn.functional.softmax(scores, dim=-1), num_samples=1).squeeze(1)
        else:
            next_tokens = torch.argmax(scores, dim=-1)
        if eos is not None:
            next_tokens = next_tokens * unfinished + pad * (1 - unfinished)
        ids[:, P + n] = next_tokens
        n += 1
        if eos is not None:
            unfinished = unfinished & ~torch.isin(next_tokens, eos)
            if not bool(unfinished.any()):
                break
        seen = length
        last_pos = last_pos + 1
        if drop_finished:
            rows = _compact(cache, rows, unfinished, min_rows)
        step_ids = ids[:, P + n - 1 : P + n] if rows is None else ids[rows, P + n - 1 : P + n]
        step_pos = last_pos if rows is None else last_pos[rows]
    return ids[:, : P + n]


def sample_inverse_cdf(probs: torch.Tensor) -> torch.Tensor:
    """(B,) one token per row of ``probs`` (B, V) (non-negative, any positive sum) by inverse transform
    sampling: the first index whose cumulative sum exceeds u · total, u ~ U[0, 1), one uniform per row
    (``torch.multinomial`` draws V exponentials per row, 12% of the 5.2M bench model's generation).

    Samples the same categorical distribution as ``torch.multinomial`` (to the float32 rounding of
    the cumulative sum), from a different random stream. A zero-probability token is never returned:
    u · total is kept below the total, and a token whose probability is 0 adds nothing to the sum.

    Raises:
        RuntimeError: a row whose sum is not a positive finite number (inf or NaN probabilities, e.g.
            from a diverged model, or all zero), as ``torch.multinomial`` refuses them; named by row.
    """
    cdf = probs.cumsum(-1)  # (B, V)
    total = cdf[:, -1:]  # (B, 1)
    bad = ~(torch.isfinite(total) & (total > 0)).squeeze(1)  # NaN or inf anywhere in a row reaches its sum
    if bool(bad.any()):
        rows = bad.nonzero().squeeze(1).tolist()
        raise RuntimeError(
            f"probability tensor contains either inf, nan or a row that sums to <= 0 (rows {rows[:8]}); the model's "
            "logits are not finite"
        )
    # (B, 1), < total
    x = torch.minimum(torch.rand_like(total) * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, x, right=True).squeeze(1)


def _apply(processors, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """``LogitsProcessorList.__call__`` without its per-call signature inspection (no processor here takes
    extra keyword arguments: ``generate``'s list passes none either)."""
    for processor in processors:
        scores = processor(input_ids, scores)
    return scores


def _compact(cache, rows: torch.Tensor | None, unfinished: torch.Tensor, min_rows: int) -> torch.Tensor | None:
    """The rows to step next, (A',) batch indices, after dropping finished ones from ``cache`` (in place).

    Compacts only when at most 3/4 of the stepped rows are unfinished (each compaction copies the filled
    cache of the rows kept), and keeps at least ``min_rows`` rows (finished ones fill up), because a BLAS
    may pick another kernel for a very small batch and change a row's last bits (measured: bitwise for
    5 rows and more, not for 1–3, with MKL on this CPU)."""
    B = unfinished.shape[0]
    current = torch.arange(B, device=unfinished.device) if rows is None else rows  # (A,)
    alive = unfinished[current].bool()  # (A,)
    A, u = current.shape[0], int(alive.sum())
    if A <= min_rows or u > 3 * A // 4:
        return rows
    keep = alive.clone()
    extra = min(min_rows, A) - u
    if extra > 0:  # the first finished rows fill up to the floor
        keep[(~alive).nonzero().squeeze(1)[:extra]] = True
    local = keep.nonzero().squeeze(1)  # (A',) positions in the current cache order
    cache.batch_select_indices(local)
    return current[local]
