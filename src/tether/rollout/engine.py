"""The generation protocol: what every rollout engine implements, whatever runs it (HF, vLLM, vLLM replicas).

An engine turns *token ids* into sampled token ids. A request is a context (the prompt, or for a turn of a
multi-turn episode everything so far) and its sampling settings; a result is the tokens the engine sampled,
the engine's own log-probabilities of exactly those tokens (log π_engine(a_t | s_t), nats, at the request's
temperature after top-k/top-p: the behaviour policy of rollout correction, ``DESIGN.md``), and why it stopped.
Nothing above the engine sees text it generated or a padded tensor it made: the rollout runner
(:class:`tether.rollout.runner.RolloutRunner`) collates results into a :class:`tether.batch.RolloutBatch`.

Shapes: lists of ints per request (no padding); log-probs one float per sampled token.
Source: verl's ``BaseRollout`` (``generate_sequences``, ``update_weights``, ``release``/``resume``) with a
name registry (``tether.engines``); vLLM's ``CompletionOutput`` (``token_ids``, ``logprobs``,
``finish_reason``), whose finish reasons tether names ``eos`` / ``length`` / ``stop`` / ``abort``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal, Protocol, runtime_checkable

import torch

#: Why a sampled sequence ended: ``eos`` it sampled an end-of-sequence id (kept as its last token);
#: ``length`` it reached ``max_new_tokens`` first (DAPO's overlong samples); ``stop`` it produced one
#: of the request's stop strings; ``abort`` the engine gave up on it (what it sampled is kept).
FinishReason = Literal["eos", "length", "stop", "abort"]
FINISH_REASONS: tuple[str, ...] = ("eos", "length", "stop", "abort")


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples (``rollout.*``; validation and ``tether eval`` override some).

    Attributes:
        temperature: softmax(logits / temperature) (> 0); ignored when ``do_sample`` is False.
        top_p: nucleus threshold in (0, 1]; 1 = off.
        top_k: keep the k most likely tokens; 0 = off.
        max_new_tokens: the most tokens sampled for this request (≥ 1).
        do_sample: False decodes greedily (arg max).
        stop: strings that end the response when produced (``finish_reason="stop"``); engines whose
            :attr:`EngineCapabilities.stop_strings` is False refuse a request that sets them.
        logprobs: also return the sampled tokens' log-probs (engines with
            :attr:`EngineCapabilities.logprobs`); the HF engine computes them at a cost, vLLM for free.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256
    do_sample: bool = True
    stop: tuple[str, ...] = ()
    logprobs: bool = False

    def override(self, **changes) -> SamplingParams:
        """A copy with ``changes`` (None values ignored: the engine's setting stays).

        Raises:
            TypeError: a key that is not a sampling setting (naming it).
        """
        unknown = sorted(set(changes) - set(self.__dataclass_fields__))
        if unknown:
            raise TypeError(f"unsupported sampling setting(s) {unknown}; known: {sorted(self.__dataclass_fields__)}")
        return replace(self, **{k: v for k, v in changes.items() if v is not None})


@dataclass(frozen=True)
class GenerationRequest:
    """One sequence to continue: ``prompt_ids`` (the whole context, token ids, no padding) and its sampling."""

    prompt_ids: Sequence[int]
    params: SamplingParams = field(default_factory=SamplingParams)


@dataclass
class GenerationResult:
    """What the engine sampled for one request.

    Attributes:
        token_ids: the sampled ids, in order; a sequence that ended on EOS ends with that EOS id.
        logprobs: log π_engine(a_t | s_t) of each sampled id, nats (``len(token_ids)`` floats; NaN where
            the engine did not report one), or None when the request did not ask for them.
        finish_reason: one of :data:`FINISH_REASONS`.
    """

    token_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str

    def __post_init__(self) -> None:
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"finish_reason must be one of {FINISH_REASONS}, got {self.finish_reason!r}")
        if self.logprobs is not None and len(self.logprobs) != len(self.token_ids):
            raise ValueError(f"{len(self.logprobs)} log-probs for {len(self.token_ids)} sampled tokens")


@dataclass(frozen=True)
class EngineCapabilities:
    """What an engine can do, declared once (callers never probe attributes).

    Attributes:
        logprobs: returns the sampled tokens' own log-probs when a request asks (``SamplingParams.logprobs``).
        stop_strings: honours ``SamplingParams.stop``.
        continues_from_ids: a request may be any token-id context, e.g. a prompt followed by earlier turns and
            tool outputs, and the engine continues it exactly as given (no re-tokenisation of text).
        sleeps: :meth:`GenerationEngine.sleep` frees the engine's memory between rollouts (vLLM's sleep mode).
        holds_weights: the engine keeps its own copy of the weights, which :meth:`GenerationEngine.sync_weights`
            overwrites (vLLM); False: it runs the module it is given (HF generate on the actor itself).
    """

    logprobs: bool = True
    stop_strings: bool = False
    continues_from_ids: bool = True
    sleeps: bool = False
    holds_weights: bool = False


@runtime_checkable
class GenerationEngine(Protocol):
    """A rollout engine (``rollout.engine``): the HF engine, vLLM in this process, vLLM replicas under Ray.

    ``name`` is its ``rollout.engine`` value; ``capabilities`` what it can do.
    """

    name: str
    capabilities: EngineCapabilities

    def generate(self, requests: Sequence[GenerationRequest], *, seed: int | None = None) -> list[GenerationResult]:
        """One result per request, in order.

        ``seed``: this call's sampling seed, so the samples are a function of the weights, the requests and it;
        None: the engine's own stream (the HF engine: torch's global RNG; vLLM: a seed drawn from it, so a
        resumed run whose checkpoint restored that RNG samples what the uninterrupted run did).

        Raises:
            ValueError: a request the engine cannot serve (stop strings it does not honour, log-probs it
                cannot return), naming it.
        """

    def sync_weights(self, model: torch.nn.Module | None) -> None:
        """Take the policy's current weights (after an update, a resume or a rollback)."""

    def sleep(self) -> None:
        """Free what the engine holds between rollouts, where it can (``capabilities.sleeps``); else nothing."""

    def wake(self) -> None:
        """Undo :meth:`sleep` (``generate`` also wakes a sleeping engine)."""

    def close(self) -> None:
        """Release the engine's resources; it is not used again."""


@runtime_checkable
class StreamsWeights(Protocol):
    """An engine that loads named weights pushed to it, one bucket at a time (what a Ray replica needs)."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> str:
        """Load ``(Hugging Face name, tensor)`` pairs in place; returns the loading path used."""

    def reset_prefix_cache(self) -> None:
        """Drop cached KV entries computed with the weights before a push."""


def draw_seed() -> int:
    """A sampling seed for one engine call, drawn from torch's global RNG (which every checkpoint saves)."""
    return int(torch.randint(0, 2**31 - 1, (1,)).item())


def check_requests(engine: GenerationEngine, requests: Sequence[GenerationRequest]) -> None:
    """Refuse what ``engine`` cannot serve, before any work.

    Raises:
        ValueError: a request with stop strings for an engine without ``stop_strings``, or asking for
            log-probs from one without ``logprobs``, or with no prompt token (naming the request's index).
    """
    caps = engine.capabilities
    for i, r in enumerate(requests):
        if not len(r.prompt_ids):
            raise ValueError(f"request {i}: an empty prompt (no token to continue)")
        if r.params.stop and not caps.stop_strings:
            raise ValueError(
                f"request {i}: stop strings {list(r.params.stop)} but rollout.engine={engine.name} has none"
            )
        if r.params.logprobs and not caps.logprobs:
            raise ValueError(f"request {i}: log-probs asked of rollout.engine={engine.name}, which returns none")


def left_pad(sequences: Sequence[Sequence[int]], pad_id: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists as (B, P) left-padded int64 ids and their (B, P) mask (1 = token), P = the longest."""
    P = max(len(x) for x in sequences)
    ids = torch.full((len(sequences), P), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), P), dtype=torch.long)
    for i, x in enumerate(sequences):
        if len(x):
            ids[i, P - len(x) :] = torch.as_tensor(list(x), dtype=torch.long)
            mask[i, P - len(x) :] = 1
    return ids.to(device), mask.to(device)


def results_from_padded(
    response_ids: torch.Tensor, eos_token_ids: Sequence[int], logprobs: torch.Tensor | None = None
) -> list[GenerationResult]:
    """Rows of a batched engine's (B, T) output as results: each row up to and including its first EOS
    (``eos``), or whole when it has none (``length``); ``logprobs`` (B, T), nats, cut alike."""
    eos = set(int(e) for e in eos_token_ids)
    out = []
    lp_rows = logprobs.tolist() if logprobs is not None else None
    for i, row in enumerate(response_ids.tolist()):
        end = next((t + 1 for t, tok in enumerate(row) if tok in eos), None)
        ids = row if end is None else row[:end]
        lp = None if lp_rows is None else lp_rows[i][: len(ids)]
        out.append(GenerationResult(ids, lp, "length" if end is None else "eos"))
    return out


def pad_results(
    results: Sequence[GenerationResult], pad_id: int, device=None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(response_ids (B, T), logprobs (B, T) or None)``: results right-padded to the longest (T ≥ 1) with
    ``pad_id`` (log-probs with 0; NaN kept where the engine reported none); log-probs None when no result has them."""
    T = max(1, max((len(r.token_ids) for r in results), default=0))
    ids = torch.full((len(results), T), pad_id, dtype=torch.long)
    with_lp = any(r.logprobs is not None for r in results)
    lp = torch.zeros((len(results), T), dtype=torch.float32) if with_lp else None
    for i, r in enumerate(results):
        n = len(r.token_ids)
        if n:
            ids[i, :n] = torch.as_tensor(r.token_ids, dtype=torch.long)
            if lp is not None:
                lp[i, :n] = torch.as_tensor(
                    r.logprobs if r.logprobs is not None else [math.nan] * n, dtype=torch.float32
                )
    return ids.to(device), (lp.to(device) if lp is not None else None)
