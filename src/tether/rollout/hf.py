"""The ``hf`` engine: Hugging Face ``generate`` (or tether's exact decode loop) on the policy module itself.

The CPU path, and the engine ``rollout.engine=auto`` falls back to. :func:`build` and :func:`check_usable` are
its registry hooks (``tether.engines``, ``tether.rollout.registry``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tether.models import autocast
from tether.rollout.engine import (
    EngineCapabilities,
    GenerationRequest,
    GenerationResult,
    SamplingParams,
    check_requests,
    left_pad,
    results_from_padded,
)
from tether.rollout.hf_decode import cache_keyword


def response_mask_from_ids(response_ids: torch.Tensor, eos_token_id: int | list[int]) -> torch.Tensor:
    """(B, T) 1 for response tokens up to and including the first EOS, 0 after it.

    A row without EOS was truncated at the length limit: all its tokens count.
    """
    eos = torch.as_tensor(
        eos_token_id if isinstance(eos_token_id, list) else [eos_token_id], device=response_ids.device
    )
    is_eos = torch.isin(response_ids, eos).long()  # (B, T)
    # tokens strictly after the first EOS have a cumulative EOS count >= 1 excluding themselves
    after_eos = (is_eos.cumsum(-1) - is_eos) > 0
    return (~after_eos).long()


def truncated_rows(response_ids: torch.Tensor, eos_token_id: int | list[int]) -> torch.Tensor:
    """(B,) bool: the rows with no EOS, which :func:`response_mask_from_ids` counts whole: a response
    cut at the length limit before it ended (DAPO's "overlong" samples; ``algo.mask_truncated``)."""
    eos = torch.as_tensor(
        eos_token_id if isinstance(eos_token_id, list) else [eos_token_id], device=response_ids.device
    )
    return ~torch.isin(response_ids, eos).any(-1)


class SampledLogprobs:
    """A ``generate`` logits processor that records each sampled token's log-prob, nats:
    log softmax(scores_t / temperature)[a_t], from the scores ``generate`` passes it (the model's
    logits after the processors before it, e.g. ``suppress_tokens``; before top-k/top-p, which
    ``generate`` applies after every user processor). It returns the scores unchanged, so sampling
    is not affected.

    The token sampled from step t's scores is only known at step t + 1 (the last column of
    ``input_ids``), so one (B, V) log-softmax is held pending; :meth:`logprobs` resolves the last one.
    """

    def __init__(self, temperature: float):
        self.temperature = temperature
        self.pending: torch.Tensor | None = None  # (B, V) the last step's log-softmax
        self.done: list[torch.Tensor] = []  # one (B,) per resolved step

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.pending is not None:
            self.done.append(self.pending.gather(-1, input_ids[:, -1:]).squeeze(-1))
        self.pending = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        return scores

    def logprobs(self, response_ids: torch.Tensor) -> torch.Tensor:
        """(B, T) float32 log-probs of ``response_ids`` (B, T), the tokens ``generate`` returned."""
        T = response_ids.shape[1]
        if len(self.done) < T and self.pending is not None:  # the last token's distribution is still pending
            self.done.append(self.pending.gather(-1, response_ids[:, len(self.done) : len(self.done) + 1]).squeeze(-1))
        self.pending = None
        return (
            torch.stack(self.done[:T], dim=1) if T else response_ids.new_zeros(response_ids.shape, dtype=torch.float32)
        )


class HFRolloutEngine:
    """The ``hf`` engine (:class:`~tether.rollout.engine.GenerationEngine`): samples with ``model.generate`` (or
    tether's exact decode loop) on the policy module itself, from left-padded prompts.

    Sampling uses softmax(logits / temperature), nucleus ``top_p`` and optional ``top_k``; the trainer recomputes
    log-probs with the same temperature, so the ratio π_θ/π_old is exact when top_p = 1 and top_k = 0.

    ``share_prefill`` (``rollout.share_prefill``): each distinct prompt of a run of identical consecutive rows (a
    GRPO group's G samples) is prefilled once, its KV cache copied to the run's rows (:meth:`_shared_prefill`), and
    ``generate`` starts at the last prompt token.

    ``hf_decode`` (``rollout.hf_decode``): ``"tether"`` decodes with :func:`tether.rollout.hf_decode.decode`
    (tether's own loop over a preallocated KV cache; the same tokens as ``model.generate`` for a fixed seed, bit
    for bit, with less CPU time) wherever :func:`tether.rollout.hf_decode.plan` accepts the call, else
    ``model.generate``; ``"generate"`` always uses ``model.generate`` with its ``DynamicCache``.
    ``drop_finished`` (``rollout.hf_drop_finished``, tether's loop only): rows that have ended stop being run
    through the model (at least 8 are kept; :func:`tether.rollout.hf_decode._compact`). ``sampler``
    (``rollout.hf_sampler``, tether's loop only): ``"multinomial"`` (``generate``'s) or ``"inverse_cdf"``
    (:func:`tether.rollout.hf_decode.sample_inverse_cdf`: the same distribution, one uniform per row, other tokens
    for a given seed).

    A request asking for log-probs (``SamplingParams.logprobs``: ``actor.old_logprobs_source=rollout``,
    ``algo.rollout_correction``) gets the sampled tokens' log-probs at the sampling temperature, from
    ``generate``'s own forward passes (KV cache, last position; :class:`SampledLogprobs`). Stop strings are not
    supported (``capabilities.stop_strings`` False).
    """

    name = "hf"
    capabilities = EngineCapabilities(
        logprobs=True, stop_strings=False, continues_from_ids=True, sleeps=False, holds_weights=False
    )

    #: "inference" runs generate under ``torch.inference_mode`` (no version counters or autograd
    #: bookkeeping on the KV cache), "no_grad" under ``torch.no_grad``; sampled tokens are the same.
    #: Under a bf16 ``actor.compute_dtype`` generation always runs under ``no_grad``: autocast caches
    #: each weight's bf16 cast for the whole call there, while under inference mode it casts every
    #: weight at every decode step (622 casts of the MLP weights a step on the 5.2M bench model, 110 now).
    grad_mode = "inference"

    def __init__(
        self,
        model,
        tokenizer,
        *,
        eos_token_ids: list[int] | None = None,
        compute_dtype: str = "float32",
        share_prefill: bool = True,
        hf_decode: str = "tether",
        drop_finished: bool = True,
        sampler: str = "multinomial",
    ):
        if hf_decode not in ("tether", "generate"):
            raise ValueError(f"hf_decode must be 'tether' or 'generate', got {hf_decode!r}")
        if sampler not in ("multinomial", "inverse_cdf"):
            raise ValueError(f"sampler must be 'multinomial' or 'inverse_cdf', got {sampler!r}")
        self.sampler = sampler
        self.model = model
        self.hf_decode = hf_decode
        self.drop_finished = drop_finished
        self.share_prefill = share_prefill
        self.compute_dtype = compute_dtype  # generation runs under the actor's autocast (actor.compute_dtype)
        self.tokenizer = tokenizer
        # generation stops at any of these (the tokenizer's EOS and the model's generation_config EOS ids)
        self.eos_token_ids = list(dict.fromkeys([tokenizer.eos_token_id, *(eos_token_ids or [])]))

    def generate(self, requests: Sequence[GenerationRequest], *, seed: int | None = None) -> list[GenerationResult]:
        """One result per request (:meth:`GenerationEngine.generate`): each run of consecutive requests with the
        same sampling settings is one left-padded batch (:meth:`generate_padded`), cut at each row's first EOS.
        ``seed``: sample from torch's RNG seeded so for this call (the caller's RNG left where it was); None: from
        torch's global RNG as it is (which checkpoints save).

        Raises:
            ValueError: a request with stop strings or an empty prompt.
        """
        check_requests(self, requests)
        if seed is None:
            return self._generate_runs(requests)
        devices = [self._device().index or 0] if self._device().type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            return self._generate_runs(requests)

    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _generate_runs(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        out: list[GenerationResult] = []
        start = 0
        while start < len(requests):
            params = requests[start].params
            stop = start + 1
            while stop < len(requests) and requests[stop].params == params:
                stop += 1
            ids, mask = left_pad(
                [r.prompt_ids for r in requests[start:stop]], self.tokenizer.pad_token_id, self._device()
            )
            response_ids, logprobs = self.generate_padded(ids, mask, params)
            out += results_from_padded(response_ids, self.eos_token_ids, logprobs)
            start = stop
        return out

    @staticmethod
    def generate_kwargs(params: SamplingParams) -> dict:
        """``generate`` keyword arguments of ``params`` (sampling settings ignored when greedy, as ``generate``
        wants)."""
        greedy = not params.do_sample
        return dict(
            do_sample=params.do_sample,
            temperature=None if greedy else params.temperature,
            top_p=None if greedy else params.top_p,
            top_k=None if greedy else params.top_k,
            max_new_tokens=params.max_new_tokens,
        )

    def generate_padded(
        self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, params: SamplingParams | None = None, **overrides
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Sample one response per row of a left-padded batch: what :meth:`generate` runs for each batch.

        Args:
            prompt_ids, prompt_mask: (B, P), left-padded.
            params: the sampling settings (default :class:`SamplingParams`); its ``logprobs`` also returns the
                sampled tokens' log-probs (:class:`SampledLogprobs`).
            overrides: further ``generate`` keyword arguments (e.g. ``suppress_tokens``, ``logits_processor``).
        Returns:
            ``(response_ids (B, T), logprobs (B, T) or None)``: T ≤ max_new_tokens, padded with the pad token after
            EOS (an ordinary tensor, usable in a later autograd pass); logprobs float32, nats,
            log π(a_t | s_t) at the sampling temperature (1 when greedy), meaningless after a row's EOS.
        """
        params = params or SamplingParams()
        was_training = self.model.training
        self.model.eval()
        kwargs = {**self.generate_kwargs(params), **overrides}
        recorder = None
        if params.logprobs:
            from transformers import LogitsProcessorList

            temperature = float(kwargs.get("temperature") or 1.0) if kwargs.get("do_sample", True) else 1.0
            recorder = SampledLogprobs(temperature)
            kwargs["logits_processor"] = LogitsProcessorList([*(kwargs.get("logits_processor") or []), recorder])

        inference = self.grad_mode == "inference" and self.compute_dtype == "float32"
        mode = torch.inference_mode() if inference else torch.no_grad()
        with mode, autocast(prompt_ids.device, self.compute_dtype):
            out = self._generate(prompt_ids, prompt_mask, kwargs)
            response_ids = out[:, prompt_ids.shape[1] :]
            logprobs = recorder.logprobs(response_ids) if recorder is not None else None
        if was_training:
            self.model.train()
        response_ids = response_ids.clone()  # cloned outside inference mode: a normal tensor
        return response_ids, (None if logprobs is None else logprobs.clone())

    def sleep(self) -> None:
        """Nothing: the engine holds no memory of its own between rollouts."""

    def wake(self) -> None:
        """Nothing (see :meth:`sleep`)."""

    def close(self) -> None:
        """Nothing: the module is the actor's."""

    def _generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, kwargs: dict) -> torch.Tensor:
        """(B, P + T) prompts and responses, from tether's decode loop or ``model.generate`` (``hf_decode``)."""
        common = dict(pad_token_id=self.tokenizer.pad_token_id, eos_token_id=self.eos_token_ids, use_cache=True)
        if self.hf_decode == "tether":
            try:
                from tether.rollout import hf_decode
            except ImportError:  # a transformers without the cache classes it builds on: generate serves every call
                hf_decode = None
            config = hf_decode.plan(self.model, {**kwargs, **common}) if hf_decode is not None else None
            if config is not None:
                share = self.share_prefill and not {"cache", "past_key_values"} & set(kwargs)
                prefill = (
                    (lambda cache: self._shared_prefill(prompt_ids, prompt_mask, cache) is not None) if share else None
                )
                return hf_decode.decode(
                    self.model,
                    prompt_ids,
                    prompt_mask,
                    config,
                    logits_processor=kwargs.get("logits_processor"),
                    prefill=prefill,
                    drop_finished=self.drop_finished,
                    sampler=self.sampler,
                )
        if self.share_prefill and not {"cache", "past_key_values"} & set(kwargs):
            shared = self._shared_prefill(prompt_ids, prompt_mask)
            if shared is not None:
                kwargs = {**kwargs, shared[0]: shared[1]}
        return self.model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, **common, **kwargs)

    def _shared_prefill(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, cache=None):
        """``(generate's cache keyword, cache)``: a KV cache (B rows) of the first P - 1 prompt positions,
        computed once per run of identical consecutive rows; None when no two consecutive rows are
        equal (or P < 2). The keyword is ``cache`` (transformers 5) or ``past_key_values``.

        ``cache``: an empty cache to fill (:func:`tether.rollout.hf_decode.preallocated_cache`), left
        untouched when None is returned; None: the model's default (``DynamicCache``)."""
        B, P = prompt_ids.shape
        if P < 2 or B < 2:
            return None
        same = (prompt_ids[1:] == prompt_ids[:-1]).all(-1) & (prompt_mask[1:] == prompt_mask[:-1]).all(-1)  # (B-1,)
        if not bool(same.any()):
            return None
        first = torch.cat([same.new_ones(1), ~same])  # (B,) the first row of each run
        group = first.long().cumsum(0) - 1  # (B,) each row's run
        ids, mask = prompt_ids[first, :-1], prompt_mask[first, :-1]  # (U, P-1)
        position_ids = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1)  # pad positions are masked out
        given = {}
        if cache is not None:
            given = {cache_keyword(self.model): cache}
        out = self.model(
            input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=True, logits_to_keep=1, **given
        )
        name = "cache" if "cache" in out else "past_key_values"
        cache = out[name]
        cache.batch_select_indices(group)  # (U, ...) -> (B, ...): each row gets its run's entries
        return name, cache

    def sync_weights(self, model) -> None:
        """The HF engine shares the actor's module: nothing to push."""
        self.model = model


# ---------------------------------------------------------------------------- registry hooks (tether.engines)
def check_usable(model_path, *, key: str = "actor.model", value: str | None = None) -> str:
    """HF generate runs wherever tether runs: what it will run, never an error."""
    return "HF generate runs every model transformers loads"


def build(cfg, *, model, tokenizer, model_path, eos_token_ids: list[int]) -> HFRolloutEngine:
    """The engine over the policy module ``model`` itself, from ``rollout.*`` (``compute_dtype``, ``share_prefill``,
    ``hf_decode``, ``hf_drop_finished``, ``hf_sampler``) and ``actor.compute_dtype``."""
    r = cfg.rollout
    return HFRolloutEngine(
        model,
        tokenizer,
        eos_token_ids=eos_token_ids,
        compute_dtype=r.compute_dtype or cfg.actor.compute_dtype,
        share_prefill=r.share_prefill,
        hf_decode=r.hf_decode,
        drop_finished=r.hf_drop_finished,
        sampler=r.hf_sampler,
    )
