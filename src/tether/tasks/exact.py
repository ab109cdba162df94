"""Exact enumeration of a small response space, and the exact KL-regularized optimum.

For a prompt x, :func:`enumerate_policy` lists every response y a sampler with ``max_new_tokens``
can produce (any sequence over the whole vocabulary that ends at the first EOS, or is cut at the
length limit) with its exact log-probability log π(y|x) at a sampling temperature (top_p = 1, no
top-k). The prefixes of each depth are run through the model in batches, without a KV cache; the
cost is ``sum_{d<T} (V-1)^d`` prefix rows for vocabulary size V and T = ``max_new_tokens`` (2,955
rows and 41,371 responses for the digit-sum task's V = 15, T = 4).

On top of it, with float64 sums throughout:

* :func:`exact_optimum`: π*(y|x) ∝ π_ref(y|x)·exp(r(x,y)/β), the maximiser of
  E_π[r] − β·KL(π‖π_ref), with value β·log E_ref[exp(r/β)] (Rafailov et al. 2023, "Direct Preference
  Optimization", eq. 4; earlier Peters & Schaal 2007, Korbak et al. 2022);
* :func:`exact_kl`, :func:`exact_kl_per_token`, :func:`exact_objective`, :func:`entropy`;
* :func:`expected_kl_estimators`: the exact expectation and spread of the sampled k1/k2/k3 KL
  estimators (Schulman 2020) as a trainer computes them;
* :func:`evaluate_prompt` / :func:`evaluate_policy`: a trained policy against π_ref and π*.

Units: log-probabilities and KLs are in nats. ``_seq`` quantities are per response (summed over its
tokens); ``_tok`` quantities are per response token: the expectation over responses of the response's
masked mean over its tokens, which is what the trainer's ``kl/ref_mean`` estimates. A response's
length counts its EOS token.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tether.tasks import digitsum, digitsum_hack, digitsum_tool

#: Refuse to enumerate spaces larger than this many responses unless asked to.
MAX_RESPONSES = 2_000_000


# --------------------------------------------------------------------------------------------------
# enumeration


@dataclass(frozen=True, eq=False)
class ResponseSpace:
    """Every response of a prompt with its exact log-probability under one policy.

    Attributes (N responses, T = ``max_new_tokens``):
        prompt: the prompt text; ``prompt_ids``: its token ids (with BOS), a tuple.
        token_ids: N tuples of response token ids (EOS included where the response ended with it).
        ids: (N, T) int64 array of the same ids, padded with -1.
        texts: N decoded responses (``skip_special_tokens=True``).
        logprobs: (N,) float64, log π(y|x) in nats at ``temperature``.
        token_logprobs: (N, T) float64, log π(y_t | x, y_<t), 0 after the response's end.
        lengths: (N,) int64, tokens per response, EOS included (1..T).
        ended_with_eos: (N,) bool; False for responses cut at the length limit.

    The order of responses depends only on the vocabulary size, EOS id and ``max_new_tokens``, so two
    spaces of the same prompt under different models (policy and reference) align row by row.
    """

    prompt: str
    prompt_ids: tuple[int, ...]
    token_ids: tuple[tuple[int, ...], ...]
    ids: np.ndarray
    texts: tuple[str, ...]
    logprobs: np.ndarray
    token_logprobs: np.ndarray
    lengths: np.ndarray
    ended_with_eos: np.ndarray
    temperature: float
    max_new_tokens: int

    def __len__(self) -> int:
        return len(self.texts)

    @property
    def probs(self) -> np.ndarray:
        """(N,) float64 probabilities."""
        return np.exp(self.logprobs)

    @property
    def total_mass(self) -> float:
        """Σ_y π(y|x); 1 up to float rounding (the float32 model's softmax)."""
        return float(np.exp(_logsumexp(self.logprobs)))

    def rewards(
        self,
        reward_fn: Callable[..., float] = digitsum.compute_score,
        ground_truth: Any = None,
        extra_info: dict | None = None,
    ) -> np.ndarray:
        """(N,) float64 rewards ``reward_fn(text, ground_truth, extra_info)`` of every response.

        ``ground_truth=None`` parses it from a digit-sum prompt. Each distinct text is scored once.
        Raises ValueError if a reward is not a finite number.
        """
        if ground_truth is None:
            ground_truth = digitsum.parse_prompt(self.prompt)
        cache: dict[str, float] = {}
        out = np.empty(len(self.texts), dtype=np.float64)
        for i, t in enumerate(self.texts):
            r = cache.get(t)
            if r is None:
                r = float(reward_fn(t, ground_truth, extra_info))
                if not math.isfinite(r):
                    raise ValueError(f"reward_fn returned {r!r} for response {t!r}")
                cache[t] = r
            out[i] = r
        return out

    def batch_rewards(self, score_texts: Callable[[list[str]], Sequence[float]]) -> np.ndarray:
        """(N,) float64 rewards from one call ``score_texts(distinct_texts)`` over the distinct response texts (a
        reward manager's batch: a user ``reward.function``, a reward model); NaN where it could not score one (the
        caller decides what that counts). Raises ValueError when it returns the wrong number of scores."""
        distinct = list(dict.fromkeys(self.texts))
        scores = np.asarray(score_texts(distinct), dtype=np.float64)
        if scores.shape != (len(distinct),):
            raise ValueError(f"score_texts returned {scores.shape} scores for {len(distinct)} distinct responses")
        index = {t: i for i, t in enumerate(distinct)}
        return scores[[index[t] for t in self.texts]]

    def aligned_with(self, other: ResponseSpace) -> bool:
        """True when ``other`` lists the same responses in the same order (same prompt and T)."""
        return (
            self.prompt_ids == other.prompt_ids
            and self.ids.shape == other.ids.shape
            and bool(np.array_equal(self.ids, other.ids))
        )


def response_space_size(vocab_size: int, max_new_tokens: int) -> int:
    """Number of responses: Σ_{d<T} (V-1)^d ended by EOS, plus (V-1)^T cut at the limit."""
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be >= 2, got {vocab_size!r}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens!r}")
    b = vocab_size - 1
    return sum(b**d for d in range(max_new_tokens)) + b**max_new_tokens


@torch.inference_mode()
def enumerate_policy(
    model,
    tokenizer,
    prompt: str,
    max_new_tokens: int,
    temperature: float = 1.0,
    *,
    batch_size: int = 8192,
    max_responses: int = MAX_RESPONSES,
    prompt_ids: Sequence[int] | None = None,
    kv_cache: bool = False,
) -> ResponseSpace:
    """Enumerate every response of ``prompt`` with its exact log-probability under ``model``.

    The prompt is encoded with ``tokenizer(prompt)`` (special tokens added, so BOS comes first),
    exactly as a trainer encodes it before ``model.generate``. At depth d every prefix of d non-EOS
    tokens is run through the model (in chunks of ``batch_size`` rows, no padding, no KV cache); the
    next-token distribution is ``log_softmax(logits / temperature)`` in float64, matching sampling
    with ``do_sample=True, temperature, top_p=1`` and no top-k. A response ends at EOS or after
    ``max_new_tokens`` tokens. The model's training/eval mode is restored afterwards.

    Args:
        model: a causal LM returning ``.logits`` of shape (B, L, V).
        tokenizer: its tokenizer; needs ``eos_token_id``.
        prompt: prompt text.
        max_new_tokens: T, the generation budget (``>= 1``).
        temperature: sampling temperature (``> 0``).
        batch_size: prefix rows per forward pass.
        max_responses: refuse larger spaces (see :func:`response_space_size`).
        prompt_ids: the context's token ids in place of ``tokenizer(prompt)``'s (a later turn's context: the
            prompt, the earlier turns and observations as the turn loop appended them).
        kv_cache: run the context once and each depth's prefixes only on their last token, on the keys/values of
            the depth before (:class:`_KVStepper`; a Hugging Face model with ``sdpa`` attention;
            :func:`enumerate_trajectories` turns it on): the same log-probabilities to the model's float32 rounding
            (up to ~1e-4 nats on a rare token of the tool task's reference, as far as the float32 no-cache path is
            from a float64 run), not bit for bit, so off by default.

    Returns:
        A :class:`ResponseSpace` with N = ``response_space_size(V, T)`` responses.

    Raises:
        ValueError: for a non-positive ``temperature``/``max_new_tokens``/``batch_size``, a tokenizer
            without EOS, an empty prompt encoding, or a space larger than ``max_responses``.
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 (greedy decoding is not enumerated), got {temperature!r}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size!r}")
    if kv_cache and not _kv_cache_supported(model):
        raise ValueError("kv_cache=True needs a transformers model with sdpa or tether attention")
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("tokenizer has no eos_token_id; responses could not end")
    prompt_ids = list(tokenizer(prompt)["input_ids"]) if prompt_ids is None else [int(i) for i in prompt_ids]
    if not prompt_ids:
        raise ValueError(f"prompt {prompt!r} encodes to no tokens")
    return _enumerate_contexts(
        model, tokenizer, prompt, [prompt_ids], max_new_tokens, temperature, batch_size, max_responses, kv_cache
    )[0]


@torch.inference_mode()
def _enumerate_contexts(
    model,
    tokenizer,
    prompt,
    contexts,
    max_new_tokens,
    temperature,
    batch_size,
    max_responses,
    kv_cache=False,
    like: ResponseSpace | None = None,
) -> list[ResponseSpace]:
    """:func:`enumerate_policy` of several contexts of one length at once (a later turn's contexts: the prompt, an
    earlier turn and its observation): the prefix tree is the same for each, so every depth is one batch of
    contexts × prefixes. One :class:`ResponseSpace` per context, in order. ``kv_cache``: each depth runs only the
    prefixes' last tokens on the keys/values of their parents (:class:`_KVStepper`) in place of whole rows. ``like``:
    an earlier space of the same tokenizer whose ``token_ids``/``texts`` (the same objects) are reused when it lists
    the same responses (the response list depends only on V, EOS and T)."""
    eos = tokenizer.eos_token_id
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    C = len(contexts)
    try:
        p_ids = torch.tensor(contexts, dtype=torch.long, device=device)  # (C, L)
        stepper = _KVStepper(model, p_ids, temperature, batch_size, max_new_tokens) if kv_cache else None
        vocab = None
        # live prefixes at the current depth d: ids (P, d) and, per context, their token logprobs (C, P, d)
        pre_ids = torch.zeros((1, 0), dtype=torch.long)
        pre_tok = torch.zeros((C, 1, 0), dtype=torch.float64)
        done_ids, done_tok, done_eos = [], [], []
        for _ in range(max_new_tokens):
            if stepper is None:
                next_lp = _next_token_logprobs(model, p_ids, pre_ids, temperature, batch_size)  # (C, P, V)
            else:
                next_lp = stepper(pre_ids)
            if vocab is None:
                vocab = next_lp.shape[-1]
                if not 0 <= eos < vocab:
                    raise ValueError(f"eos_token_id {eos} is outside the model's vocabulary of {vocab}")
                n = response_space_size(vocab, max_new_tokens)
                if n > max_responses:
                    raise ValueError(
                        f"max_new_tokens={max_new_tokens} over a vocabulary of {vocab} gives {n} responses, more than "
                        f"max_responses={max_responses}"
                    )
                keep = torch.tensor([t for t in range(vocab) if t != eos], dtype=torch.long)
            P = pre_ids.shape[0]
            # responses that end here with EOS
            done_ids.append(torch.cat([pre_ids, torch.full((P, 1), eos, dtype=torch.long)], dim=1))
            done_tok.append(torch.cat([pre_tok, next_lp[:, :, eos : eos + 1]], dim=2))
            done_eos.append(torch.ones(P, dtype=torch.bool))
            # extend by every non-EOS token
            B = keep.numel()
            pre_ids = torch.cat([pre_ids.repeat_interleave(B, dim=0), keep.repeat(P).unsqueeze(1)], dim=1)
            step_lp = next_lp[:, :, keep].reshape(C, -1, 1)
            pre_tok = torch.cat([pre_tok.repeat_interleave(B, dim=1), step_lp], dim=2)
        # responses cut at the length limit
        done_ids.append(pre_ids)
        done_tok.append(pre_tok)
        done_eos.append(torch.zeros(pre_ids.shape[0], dtype=torch.bool))
    finally:
        model.train(was_training)

    T = max_new_tokens
    N = sum(x.shape[0] for x in done_ids)
    ids = np.full((N, T), -1, dtype=np.int64)
    tok = np.zeros((C, N, T), dtype=np.float64)
    lengths = np.empty(N, dtype=np.int64)
    row = 0
    for a, b in zip(done_ids, done_tok, strict=True):
        n, d = a.shape
        ids[row : row + n, :d] = a.numpy()
        tok[:, row : row + n, :d] = b.numpy()
        lengths[row : row + n] = d
        row += n
    if like is not None and np.array_equal(like.ids, ids):
        token_ids, texts = like.token_ids, like.texts
    else:
        token_ids = tuple(tuple(r[:n].tolist()) for r, n in zip(ids, lengths, strict=True))
        texts = _decode_all(tokenizer, token_ids)
    ended = torch.cat(done_eos).numpy()
    return [
        ResponseSpace(
            prompt=prompt,
            prompt_ids=tuple(int(i) for i in ctx),
            token_ids=token_ids,
            ids=ids,
            texts=texts,
            logprobs=tok[c].sum(axis=1),
            token_logprobs=tok[c],
            lengths=lengths,
            ended_with_eos=ended,
            temperature=float(temperature),
            max_new_tokens=T,
        )
        for c, ctx in enumerate(contexts)
    ]


def _decode_all(tokenizer, token_ids) -> tuple[str, ...]:
    """``tokenizer.batch_decode(token_ids, skip_special_tokens=True)``; for a fast tokenizer without
    space clean-up, the Rust backend is called directly (same result, ~10x faster)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return tuple(backend.decode_batch(list(token_ids), skip_special_tokens=True))
    return tuple(tokenizer.batch_decode([list(t) for t in token_ids], skip_special_tokens=True))


def _next_token_logprobs(model, contexts, prefixes, temperature, batch_size) -> torch.Tensor:
    """(C, P, V) float64 log-softmax of the last position's logits / temperature for each context (C, L) and prefix
    (P, d), in chunks of ``batch_size`` rows of context × prefix."""
    C, P = contexts.shape[0], prefixes.shape[0]
    ctx_idx = torch.arange(C).repeat_interleave(P)
    pre_idx = torch.arange(P).repeat(C)
    out = []
    for start in range(0, C * P, batch_size):
        ci, pi = ctx_idx[start : start + batch_size], pre_idx[start : start + batch_size]
        x = torch.cat([contexts[ci.to(contexts.device)], prefixes[pi].to(contexts.device)], dim=1)
        logits = model(input_ids=x, attention_mask=torch.ones_like(x)).logits[:, -1, :]
        out.append(torch.log_softmax(logits.double() / temperature, dim=-1).cpu())
    return torch.cat(out).reshape(C, P, -1)


def _kv_cache_supported(model) -> bool:
    """Whether :class:`_KVStepper` can run ``model``: a ``transformers.PreTrainedModel`` with ``sdpa`` or ``tether``
    attention (a 4D boolean mask passed as is) and transformers 5's ``DynamicCache`` (its ``layers``)."""
    from transformers import DynamicCache, PreTrainedModel

    attn = getattr(getattr(model, "config", None), "_attn_implementation", None)
    return isinstance(model, PreTrainedModel) and attn in ("sdpa", "tether") and hasattr(DynamicCache(), "layers")


class _KVStepper:
    """:func:`_next_token_logprobs` of one depth after another with a KV cache: the contexts (C, L) run once, then
    each parent prefix of depth d−1 runs its ``B`` children's last tokens as one row of B query tokens on the
    parent's keys/values (kept from depth d−1), all at position L + d − 1 and each attending to the parent's
    positions and itself only (a 4D mask), so a depth costs one token per prefix in place of L + d and no parent's
    cache is copied per child. The prefixes of depth d must be those of :func:`_enumerate_contexts`: each parent of
    depth d−1 followed by the same ``B`` tokens in turn (row p's parent is p // B). Same numbers as the full rows
    to float32 rounding (other matmul shapes). Needs a Hugging Face causal LM whose attention takes a 4D boolean
    mask (:func:`_kv_cache_supported`)."""

    def __init__(self, model, contexts, temperature, batch_size, max_new_tokens):
        self.model, self.contexts, self.temperature, self.batch_size = model, contexts, temperature, batch_size
        self.last_depth = max_new_tokens - 1
        self.kv = None  # per layer (keys, values) of the previous depth's rows (C·P, H, L + d − 1, D), (c, p) order
        self.prev = None  # the previous depth's prefixes (P, d − 1)
        # transformers 5 names the forward's cache argument ``cache`` (``past_key_values`` deprecated), 4 the latter
        self.cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def _forward(self, input_ids, past, keep_kv, **kwargs):
        from transformers import DynamicCache

        cache = DynamicCache() if past is None else DynamicCache(ddp_cache_data=past)
        logits = self.model(input_ids=input_ids, use_cache=True, **{self.cache_arg: cache}, **kwargs).logits
        kv = [(layer.keys, layer.values) for layer in cache.layers] if keep_kv else None
        return torch.log_softmax(logits.double() / self.temperature, dim=-1).cpu(), kv

    def __call__(self, prefixes: torch.Tensor) -> torch.Tensor:
        C, (P, d) = self.contexts.shape[0], prefixes.shape
        keep_kv = d < self.last_depth
        out, kv = [], []
        if d == 0:
            for s in range(0, C, self.batch_size):
                lp, chunk_kv = self._forward(self.contexts[s : s + self.batch_size], None, keep_kv)
                out.append(lp[:, -1:])
                kv.append(chunk_kv)
        else:
            P_prev = self.prev.shape[0]
            B = P // P_prev
            last = prefixes[:, -1].reshape(P_prev, B)
            if P != P_prev * B or not (
                torch.equal(prefixes[:, :-1], self.prev.repeat_interleave(B, dim=0)) and bool((last == last[0]).all())
            ):
                raise ValueError("prefixes are not the previous depth's, each followed by the same tokens")
            device = self.contexts.device
            past_len = self.kv[0][0].shape[2]  # L + d - 1: the children's position
            input_ids = last[0].to(device).expand(C * P_prev, B)
            position_ids = torch.full((1, B), past_len, dtype=torch.long, device=device)
            mask = torch.ones((1, 1, B, past_len + B), dtype=torch.bool, device=device)  # True: attend
            mask[0, 0, :, past_len:] = torch.eye(B, dtype=torch.bool, device=device)
            step = max(1, self.batch_size // B)
            for s in range(0, C * P_prev, step):
                past = [(k[s : s + step], v[s : s + step]) for k, v in self.kv]
                n = past[0][0].shape[0]
                lp, chunk_kv = self._forward(
                    input_ids[s : s + n],
                    past,
                    keep_kv,
                    position_ids=position_ids.expand(n, B),
                    attention_mask=mask.expand(n, 1, B, past_len + B),
                )
                out.append(lp)
                if keep_kv:  # each child's cache: its parent's positions, then its own
                    kv.append(
                        [
                            tuple(
                                torch.cat(
                                    [
                                        t[:, :, :past_len].repeat_interleave(B, dim=0),
                                        t[:, :, past_len:].transpose(1, 2).reshape(n * B, t.shape[1], 1, t.shape[3]),
                                    ],
                                    dim=2,
                                )
                                for t in layer
                            )
                            for layer in chunk_kv
                        ]
                    )
        self.prev = prefixes
        self.kv = (
            [tuple(torch.cat(t) for t in zip(*layer, strict=True)) for layer in zip(*kv, strict=True)]
            if keep_kv
            else None
        )
        return torch.cat(out).reshape(C, P, -1)


# --------------------------------------------------------------------------------------------------
# multi-turn trajectories with a deterministic environment


@dataclass(frozen=True, eq=False)
class TrajectorySpace:
    """Every trajectory of a prompt under a deterministic environment, with its exact probability under one policy.

    ``space`` is a :class:`ResponseSpace` over trajectories: ``token_ids`` / ``ids`` / ``token_logprobs`` hold the
    model's tokens only (the turns concatenated, observations left out: they are not actions, and a deterministic
    environment gives each the probability 1), so ``space.logprobs`` is log π(τ|x) = Σ over model tokens of
    log π(a_t | context), ``space.lengths`` counts model tokens, and ``space.texts`` are the model turns' texts
    joined with ``"|"``. ``rewards``: (N,) the sum of the per-turn rewards; ``turns``: (N,) model turns taken;
    ``answers``: the last turn's text. Two spaces of the same prompt and environment align row by row.
    """

    space: ResponseSpace
    rewards: np.ndarray
    turns: np.ndarray
    answers: tuple[str, ...]

    def __len__(self) -> int:
        return len(self.space)


def _turn_outcomes(sp: ResponseSpace, turn: int, last: bool, step, outcomes: dict):
    """(rewards (N,), ends (N,) bool, {row: observation} of the rows that go on) of one turn's space: ``step(turn,
    text)`` once per distinct text (memo ``outcomes``); a turn cut at the length limit: reward 0, no step, the end."""
    rewards = np.zeros(len(sp), dtype=np.float64)
    ends = ~sp.ended_with_eos
    observations = {}
    for i in np.flatnonzero(sp.ended_with_eos).tolist():
        text = sp.texts[i]
        got = outcomes.get(text)
        if got is None:
            obs, r, end = step(turn, text)
            r = float(r)
            if not math.isfinite(r):
                raise ValueError(f"step returned reward {r!r} for turn {turn} {text!r}")
            got = outcomes[text] = (obs, r, bool(end))
        obs, rewards[i], end = got
        if end or last:
            ends[i] = True
        else:
            observations[i] = obs
    return rewards, ends, observations


def enumerate_trajectories(
    model,
    tokenizer,
    prompt: str,
    step: Callable[[int, str], tuple[Any, float, bool]],
    max_new_tokens: int,
    *,
    max_turns: int,
    observation_ids: Callable[[Any], Sequence[int]] | None = None,
    temperature: float = 1.0,
    max_responses: int = MAX_RESPONSES,
    kv_cache: bool | None = None,
) -> TrajectorySpace:
    """Enumerate every trajectory of ``prompt``: each model turn over its whole response space
    (:func:`enumerate_policy`, ``max_new_tokens`` per turn), the environment's deterministic answer, the next turn.

    ``step(turn, text) -> (observation, reward, done)`` is the environment after model turn ``turn`` (1-based) wrote
    ``text`` (decoded without special tokens). A trajectory ends when ``done``, after ``max_turns`` turns, or at a
    turn cut by the length limit (no EOS: reward 0 and no step, as :class:`tether.rollout.agent.AgentRunner` does);
    otherwise the next turn's context is the previous context, the turn's tokens (EOS included) and
    ``observation_ids(observation)`` (default: the observation text tokenised without special tokens). Costs one
    enumeration per context that goes on (the tool task: 2). ``kv_cache`` as in :func:`enumerate_policy`; None: on
    where the model supports it (:func:`_kv_cache_supported`: a Hugging Face model with ``sdpa`` attention), off
    otherwise.

    Raises:
        ValueError: ``max_turns < 1``, and as :func:`enumerate_policy`.
    """
    if isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 1:
        raise ValueError(f"max_turns must be a positive int, got {max_turns!r}")
    if observation_ids is None:

        def observation_ids(obs):
            return tokenizer(obs, add_special_tokens=False)["input_ids"]

    if kv_cache is None:
        kv_cache = _kv_cache_supported(model)
    ctx0 = list(tokenizer(prompt)["input_ids"])

    first_space = []  # turn 1's space: later turns reuse its response list (token_ids, texts)

    def enumerate_turn(contexts, first):
        if first:  # the prompt alone: enumerate_policy checks the arguments
            first_space[:] = [
                enumerate_policy(
                    model,
                    tokenizer,
                    prompt,
                    max_new_tokens,
                    temperature,
                    max_responses=max_responses,
                    prompt_ids=contexts[0],
                    kv_cache=kv_cache,
                )
            ]
            return first_space
        return _enumerate_contexts(
            model,
            tokenizer,
            prompt,
            contexts,
            max_new_tokens,
            temperature,
            8192,
            max_responses,
            kv_cache,
            first_space[0],
        )

    # live: (context ids, model ids so far, token logprobs so far, reward so far, turn texts so far)
    live = [(ctx0, (), np.zeros(0), 0.0, ())]
    # finished trajectories in blocks: one live prefix and the rows ``idx`` of its turn's space that end there
    blocks = []
    for turn in range(1, max_turns + 1):
        nxt = []
        # the turn's contexts, one enumeration per context length (contexts of a length run in one batch)
        spaces = {}
        for length in dict.fromkeys(len(c[0]) for c in live):
            group = [j for j, c in enumerate(live) if len(c[0]) == length]
            for j, sp in zip(group, enumerate_turn([live[j][0] for j in group], turn == 1), strict=True):
                spaces[j] = sp
        outcomes = {}  # the environment is deterministic: one step per distinct text of the turn
        # ... so one (rewards, ends, observations) per response list: the turn's spaces share turn 1's (``like``)
        per_list = {}
        for j, (ctx, ids, lps, rsum, texts) in enumerate(live):
            sp = spaces[j]
            key = (id(sp.texts), id(sp.ended_with_eos))  # both held by ``spaces`` for the turn: ids stay unique
            if key not in per_list:
                per_list[key] = _turn_outcomes(sp, turn, turn == max_turns, step, outcomes)
            rewards, ends, observations = per_list[key]
            blocks.append((ids, lps, rsum, texts, sp, np.flatnonzero(ends), rewards))
            for i, obs in observations.items():
                n = int(sp.lengths[i])
                t_ids = sp.token_ids[i]
                nxt.append(
                    (
                        [*ctx, *t_ids, *observation_ids(obs)],
                        ids + t_ids,
                        np.concatenate([lps, sp.token_logprobs[i, :n]]),
                        rsum + float(rewards[i]),
                        (*texts, sp.texts[i]),
                    )
                )
        live = nxt
        if not live:
            break
    N, width = sum(len(b[5]) for b in blocks), max_new_tokens * max_turns
    ids = np.full((N, width), -1, dtype=np.int64)
    tok = np.zeros((N, width), dtype=np.float64)
    lengths = np.empty(N, dtype=np.int64)
    rewards = np.empty(N, dtype=np.float64)
    turns = np.empty(N, dtype=np.int64)
    ended = np.empty(N, dtype=bool)
    token_ids, texts, answers = [], [], []
    row = 0
    for p_ids, p_lps, rsum, p_texts, sp, idx, r in blocks:
        m, p, T = len(idx), len(p_ids), sp.max_new_tokens
        if not m:
            continue
        ids[row : row + m, :p] = p_ids
        ids[row : row + m, p : p + T] = sp.ids[idx]  # -1 after each turn's end, as the padding
        tok[row : row + m, :p] = p_lps
        tok[row : row + m, p : p + T] = sp.token_logprobs[idx]  # 0 after each turn's end
        lengths[row : row + m] = p + sp.lengths[idx]
        rewards[row : row + m] = rsum + r[idx]
        turns[row : row + m] = len(p_texts) + 1
        ended[row : row + m] = sp.ended_with_eos[idx]  # a turn's response is never empty: its last token ends it
        every = m == len(sp)  # a whole space ends here (a last turn): no indexing
        t_ids = sp.token_ids if every else [sp.token_ids[i] for i in idx]
        t_texts = sp.texts if every else [sp.texts[i] for i in idx]
        token_ids += [p_ids + t for t in t_ids] if p_ids else t_ids
        head = "|".join(p_texts) + "|" if p_texts else ""
        texts += [head + t for t in t_texts] if head else t_texts
        answers += t_texts
        row += m
    space = ResponseSpace(
        prompt=prompt,
        prompt_ids=tuple(ctx0),
        token_ids=tuple(token_ids),
        ids=ids,
        texts=tuple(texts),
        logprobs=tok.sum(axis=1),
        token_logprobs=tok,
        lengths=lengths,
        ended_with_eos=ended,
        temperature=float(temperature),
        max_new_tokens=width,
    )
    return TrajectorySpace(space=space, rewards=rewards, turns=turns, answers=tuple(answers))


# --------------------------------------------------------------------------------------------------
# exact quantities over an enumerated space


def _arr(x, name: str) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().double().numpy()
    a = np.asarray(x, dtype=np.float64)
    if a.ndim != 1 or a.size == 0:
        raise ValueError(f"{name} must be a non-empty 1-D array, got shape {a.shape}")
    if np.isnan(a).any():
        raise ValueError(f"{name} contains NaN")
    return a


def _same(a: np.ndarray, b: np.ndarray, na: str, nb: str) -> None:
    if a.shape != b.shape:
        raise ValueError(f"{na} has shape {a.shape} but {nb} has shape {b.shape}")


def _logsumexp(a: np.ndarray) -> float:
    m = float(np.max(a))
    if m == -math.inf:
        return -math.inf
    return m + math.log(float(np.sum(np.exp(a - m))))


def _finite_rewards(rewards, name: str = "rewards") -> np.ndarray:
    r = _arr(rewards, name)
    if not np.isfinite(r).all():
        raise ValueError(f"{name} must be finite")
    return r


def _check_beta(beta: float) -> float:
    beta = float(beta)
    if not beta >= 0 or not math.isfinite(beta):
        raise ValueError(f"beta must be a finite number >= 0, got {beta!r}")
    return beta


def expected_reward(logp, rewards) -> float:
    """E_π[r] = Σ_y π(y) r(y). ``logp``, ``rewards``: (N,)."""
    lp, r = _arr(logp, "logp"), _finite_rewards(rewards)
    _same(lp, r, "logp", "rewards")
    return float(np.sum(np.exp(lp) * r))


def entropy(logp) -> float:
    """H(π) = −Σ_y π(y) log π(y) in nats per response. ``logp``: (N,)."""
    lp = _arr(logp, "logp")
    p = np.exp(lp)
    m = p > 0
    return float(-np.sum(p[m] * lp[m]))


def exact_kl(logp, logq) -> float:
    """KL(p‖q) = Σ_y p(y) (log p(y) − log q(y)), nats per response (sequence level).

    ``logp``, ``logq``: (N,) log-probabilities over the same responses. Terms with p(y) = 0 count 0;
    ``inf`` when q(y) = 0 where p(y) > 0. Raises ValueError on shape mismatch or NaN.
    """
    lp, lq = _arr(logp, "logp"), _arr(logq, "logq")
    _same(lp, lq, "logp", "logq")
    p = np.exp(lp)
    m = p > 0
    if np.any(lq[m] == -math.inf):
        return math.inf
    return float(np.sum(p[m] * (lp[m] - lq[m])))


def exact_kl_per_token(logp, logq, lengths) -> float:
    """E_{y~p}[(log p(y) − log q(y)) / |y|], nats per response token.

    This is the expectation of the per-token k1 estimate a trainer logs as ``kl/ref_mean`` (a
    masked mean over each response's tokens, then a mean over responses). ``lengths``: (N,) token
    counts (EOS included), all >= 1. Raises ValueError on shape mismatch or a non-positive length.
    """
    lp, lq, n = _arr(logp, "logp"), _arr(logq, "logq"), _arr(lengths, "lengths")
    _same(lp, lq, "logp", "logq")
    _same(lp, n, "logp", "lengths")
    if np.any(n < 1):
        raise ValueError("lengths must all be >= 1")
    p = np.exp(lp)
    m = p > 0
    if np.any(lq[m] == -math.inf):
        return math.inf
    return float(np.sum(p[m] * (lp[m] - lq[m]) / n[m]))


def exact_objective(logp, ref_logp, rewards, beta: float) -> float:
    """E_π[r] − β·KL(π‖π_ref) with the sequence-level KL (nats per response).

    ``logp``, ``ref_logp``, ``rewards``: (N,). ``beta >= 0``. Raises ValueError otherwise.
    """
    beta = _check_beta(beta)
    er = expected_reward(logp, rewards)
    if beta == 0:
        return er
    return er - beta * exact_kl(logp, ref_logp)


@dataclass(frozen=True)
class Optimum:
    """The KL-regularized optimum π* for one prompt.

    Attributes:
        logprobs: (N,) float64 log π*(y|x) (``-inf`` off its support when β = 0).
        value: max_π E_π[r] − β·KL(π‖π_ref) = β·log E_ref[exp(r/β)] (max reward on the reference's
            support when β = 0).
        kl: KL(π*‖π_ref), nats per response.
        expected_reward: E_{π*}[r].
        beta: β.
    """

    logprobs: np.ndarray
    value: float
    kl: float
    expected_reward: float
    beta: float

    @property
    def objective(self) -> float:
        """E_{π*}[r] − β·KL(π*‖π_ref); equals ``value`` up to rounding."""
        return self.expected_reward - self.beta * self.kl


def exact_optimum(ref_logprobs, rewards, beta: float) -> Optimum:
    """The maximiser of E_π[r] − β·KL(π‖π_ref): π*(y) ∝ π_ref(y)·exp(r(y)/β).

    Source: the closed form of the KL-regularized objective, e.g. Rafailov et al. 2023 (DPO), eq. 4.
    Computed with a stable log-sum-exp in float64; ``ref_logprobs`` is renormalised to sum to 1 (it
    does up to float rounding when it comes from :func:`enumerate_policy`). For β = 0, π* is π_ref
    restricted to the responses of maximal reward (among those with π_ref > 0) and renormalised.

    Args:
        ref_logprobs: (N,) log π_ref(y|x), nats.
        rewards: (N,) finite rewards r(x, y).
        beta: β >= 0.

    Returns:
        :class:`Optimum` with ``logprobs`` (N,), ``value`` (β·log E_ref[exp(r/β)]), ``kl`` (nats per
        response), ``expected_reward``.

    Raises:
        ValueError: on shape mismatch, NaN, non-finite rewards, negative/non-finite β, or a reference
            with no mass.
    """
    beta = _check_beta(beta)
    lref = _arr(ref_logprobs, "ref_logprobs")
    r = _finite_rewards(rewards)
    _same(lref, r, "ref_logprobs", "rewards")
    z_ref = _logsumexp(lref)
    if z_ref == -math.inf:
        raise ValueError("ref_logprobs puts no mass anywhere (all -inf)")
    lref = lref - z_ref
    if beta == 0:
        support = lref > -math.inf
        best = float(np.max(r[support]))
        tie = support & (r >= best - 1e-12 * max(1.0, abs(best)))
        z = _logsumexp(lref[tie])
        logp = np.full_like(lref, -math.inf)
        logp[tie] = lref[tie] - z
        return Optimum(logprobs=logp, value=best, kl=float(-z), expected_reward=best, beta=0.0)
    # shift by the best reward first, so the best responses keep full precision for tiny β
    r_max = float(np.max(r))
    a = lref + (r - r_max) / beta
    log_z = _logsumexp(a)  # log E_ref[exp((r - r_max)/β)]
    logp = a - log_z
    return Optimum(
        logprobs=logp,
        value=r_max + beta * log_z,
        kl=exact_kl(logp, lref),
        expected_reward=expected_reward(logp, r),
        beta=beta,
    )


def expected_kl_estimators(policy: ResponseSpace, reference: ResponseSpace) -> dict[str, float]:
    """Exact mean and standard deviation of the sampled KL estimators k1, k2, k3 under y ~ π.

    With the per-token log-ratio l_t = log π(y_t|·) − log π_ref(y_t|·) of a sampled token:
    k1 = l_t, k2 = l_t²/2, k3 = exp(−l_t) − 1 + l_t (Schulman 2020, "Approximating KL Divergence").
    For each estimator two aggregations over a response are given: ``_tok`` (masked mean over the
    response's tokens, nats per token) and ``_seq`` (sum, nats per response). Each key ``kX_agg``
    is the exact expectation over y ~ π and ``kX_agg_std`` the standard deviation of one response's
    value. For comparison, ``kl_seq`` is the exact KL(π‖π_ref) (= E[k1_seq]) and ``kl_tok`` the exact
    per-token KL of :func:`exact_kl_per_token` (= E[k1_tok]).

    Raises ValueError if the two spaces do not list the same responses.
    """
    if not policy.aligned_with(reference):
        raise ValueError("policy and reference spaces do not list the same responses (prompt or T differ)")
    p = policy.probs
    mask = policy.ids >= 0
    lr = np.where(mask, policy.token_logprobs - reference.token_logprobs, 0.0)
    per_tok = {
        "k1": lr,
        "k2": 0.5 * lr**2,
        "k3": np.where(mask, np.expm1(-lr) + lr, 0.0),
    }
    out: dict[str, float] = {}
    n = policy.lengths.astype(np.float64)
    for name, v in per_tok.items():
        for agg, vals in (("seq", v.sum(axis=1)), ("tok", v.sum(axis=1) / n)):
            mean = float(np.sum(p * vals))
            var = float(np.sum(p * (vals - mean) ** 2))
            out[f"{name}_{agg}"] = mean
            out[f"{name}_{agg}_std"] = math.sqrt(max(var, 0.0))
    out["kl_seq"] = exact_kl(policy.logprobs, reference.logprobs)
    out["kl_tok"] = exact_kl_per_token(policy.logprobs, reference.logprobs, policy.lengths)
    return out


# --------------------------------------------------------------------------------------------------
# evaluation of a trained policy


def evaluate_prompt(
    policy: ResponseSpace,
    reference: ResponseSpace,
    rewards,
    beta: float,
    *,
    n_samples: int | None = None,
    gold=None,
) -> dict[str, float]:
    """Exact numbers for one prompt: the policy against π_ref and against π* at ``beta``.

    Keys (nats; ``_seq`` per response, ``_tok`` per response token):
        ``score_mean`` E_π[r]; ``ref_score_mean`` E_ref[r]; ``opt_score_mean`` E_{π*}[r];
        ``kl_ref_seq``, ``kl_ref_tok`` KL(π‖π_ref); ``opt_kl_ref_seq`` KL(π*‖π_ref);
        ``objective`` E_π[r] − β·KL(π‖π_ref); ``opt_objective`` its maximum (π*'s);
        ``objective_gap`` opt_objective − objective (>= 0);
        ``kl_opt_seq`` KL(π‖π*) (= objective_gap / β for β > 0); ``kl_opt_rev_seq`` KL(π*‖π);
        ``entropy_seq`` H(π); ``effective_answers`` exp H(π) (and ``ref_``/``opt_`` versions);
        ``top1_mass`` max_y π(y); ``correct_mass`` π's mass on the responses of maximal reward
        ("correct"); ``correct_effective_answers`` exp of the entropy of π restricted to them and
        renormalised (and ``ref_``/``opt_`` versions) -- how many distinct correct answers the policy
        spreads over, the mode-collapse measure;
        with ``n_samples=n``: ``collapse_rate@n`` = Σ π(y)^n, the probability that n independent
        samples are all the same response, and ``unique_frac@n`` = Σ_y (1 − (1 − π(y))^n) / n, the
        expected share of distinct responses among n samples.

    With ``gold`` (N,), the gold reward of each response when ``rewards`` is a proxy (the hackable task,
    :mod:`tether.tasks.digitsum_hack`): ``gold_mean`` E_π[gold], ``ref_gold_mean``, ``opt_gold_mean`` (π* of the
    proxy), and "correct" (``correct_mass``, ``*correct_effective_answers``) means gold-correct.

    ``policy`` and ``reference`` must list the same responses; ``rewards`` is (N,).
    Raises ValueError on misaligned spaces, bad rewards or β.
    """
    beta = _check_beta(beta)
    if not policy.aligned_with(reference):
        raise ValueError("policy and reference spaces do not list the same responses (prompt or T differ)")
    r = _finite_rewards(rewards)
    _same(policy.logprobs, r, "policy.logprobs", "rewards")
    lp, lref = policy.logprobs, reference.logprobs
    opt = exact_optimum(lref, r, beta)
    g = r if gold is None else _finite_rewards(gold, "gold")
    best = g >= float(np.max(g)) - 1e-12 * max(1.0, abs(float(np.max(g))))
    out = {
        "score_mean": expected_reward(lp, r),
        "ref_score_mean": expected_reward(lref, r),
        "opt_score_mean": opt.expected_reward,
        "kl_ref_seq": exact_kl(lp, lref),
        "kl_ref_tok": exact_kl_per_token(lp, lref, policy.lengths),
        "opt_kl_ref_seq": opt.kl,
        "objective": exact_objective(lp, lref, r, beta),
        "opt_objective": opt.value,
        "kl_opt_seq": exact_kl(lp, opt.logprobs),
        "kl_opt_rev_seq": exact_kl(opt.logprobs, lp),
        "entropy_seq": entropy(lp),
        "top1_mass": float(np.exp(np.max(lp))),
        "correct_mass": float(np.sum(np.exp(lp[best]))),
    }
    out["objective_gap"] = out["opt_objective"] - out["objective"]
    if gold is not None:
        _same(lp, g, "policy.logprobs", "gold")
        out |= {
            "gold_mean": expected_reward(lp, g),
            "ref_gold_mean": expected_reward(lref, g),
            "opt_gold_mean": expected_reward(opt.logprobs, g),
        }
    for prefix, logq in (("", lp), ("ref_", lref), ("opt_", opt.logprobs)):
        out[f"{prefix}effective_answers"] = math.exp(entropy(logq))
        sub = logq[best]
        z = _logsumexp(sub)
        out[f"{prefix}correct_effective_answers"] = math.exp(entropy(sub - z)) if z > -math.inf else 0.0
    if n_samples is not None:
        if n_samples < 1:
            raise ValueError(f"n_samples must be >= 1, got {n_samples!r}")
        p = np.exp(lp)
        out[f"collapse_rate@{n_samples}"] = float(np.sum(p**n_samples))
        out[f"unique_frac@{n_samples}"] = float(
            np.sum(-np.expm1(n_samples * np.log1p(-np.minimum(p, 1.0)))) / n_samples
        )
    return out


def evaluate_trajectories(
    policy: TrajectorySpace, reference: TrajectorySpace, beta: float, *, n_samples: int | None = None
) -> dict[str, float]:
    """:func:`evaluate_prompt` over trajectories (π* ∝ π_ref·exp(r/β) over whole trajectories, the KLs summed over
    model tokens, ``_tok`` per model token), plus the tool's use: ``tool_call_rate`` (π's probability of more than
    one turn; ``ref_``/``opt_`` versions), ``score_after_call`` E_π[r | more than one turn] and ``score_direct``
    E_π[r | one turn] (0 where π gives the case no mass).

    Holds for a deterministic environment, whose trajectory distribution is the product of the model's token
    probabilities. Raises ValueError on misaligned spaces, as :func:`evaluate_prompt`.
    """
    out = evaluate_prompt(policy.space, reference.space, reference.rewards, beta, n_samples=n_samples)
    opt = exact_optimum(reference.space.logprobs, reference.rewards, beta)
    called = reference.turns > 1
    for prefix, lq in (("", policy.space.logprobs), ("ref_", reference.space.logprobs), ("opt_", opt.logprobs)):
        out[f"{prefix}tool_call_rate"] = float(np.sum(np.exp(lq[called])))
    p, r = policy.space.probs, reference.rewards
    for name, m in (("score_after_call", called), ("score_direct", ~called)):
        mass = float(np.sum(p[m]))
        out[name] = float(np.sum(p[m] * r[m]) / mass) if mass > 0 else 0.0
    return out


def evaluate_tool_policy(
    policy,
    reference,
    tokenizer,
    rows: Sequence[Mapping],
    beta: float,
    *,
    temperature: float = 1.0,
    n_samples: int | None = None,
    ref_cache: dict | None = None,
    observation_ids: Callable[[Any], Sequence[int]] | None = None,
    prefix: str = "exact/",
) -> dict[str, float]:
    """Exact metrics of the multi-turn tool task (:mod:`tether.tasks.digitsum_tool`) over its rows: the mean over
    rows of :func:`evaluate_trajectories`'s keys, prefixed (``exact/score_mean``, ``exact/kl_ref_seq``,
    ``exact/objective_gap``, ``exact/tool_call_rate``, ...), plus ``{prefix}n_prompts``. ``ref_cache`` maps
    ``(prompt, temperature)`` to the reference's :class:`TrajectorySpace`. Two trajectory enumerations per row (one
    with a warm cache). Raises ValueError for a row that is not the task's."""
    if len(rows) == 0:
        raise ValueError("rows is empty")
    per = []
    for row in rows:
        extra = row.get("extra_info") or {} if isinstance(row, Mapping) else {}
        if not isinstance(row, Mapping) or "s" not in extra:
            raise ValueError(f"row {row!r} is not a digitsum_tool row (needs extra_info.s)")
        k, s = int(extra.get("k", digitsum_tool.DEFAULT_K)), int(extra["s"])

        def step(turn, text, k=k, s=s):
            return digitsum_tool.transition(k, s, turn, text)

        def run(model, prompt=row["prompt"], k=k, step=step):
            return enumerate_trajectories(
                model,
                tokenizer,
                prompt,
                step,
                k + 1,
                max_turns=digitsum_tool.MAX_TURNS,
                observation_ids=observation_ids,
                temperature=temperature,
            )

        key = (row["prompt"], float(temperature))
        ref_ts = ref_cache.get(key) if ref_cache is not None else None
        if ref_ts is None:
            ref_ts = run(reference)
            if ref_cache is not None:
                ref_cache[key] = ref_ts
        per.append(evaluate_trajectories(run(policy), ref_ts, beta, n_samples=n_samples))
    out = {f"{prefix}{k}": float(np.mean([d[k] for d in per])) for k in per[0]}
    out[f"{prefix}n_prompts"] = float(len(per))
    return out


def exact_space_problem(
    model, prompts: Sequence, max_new_tokens: int | None = None, max_responses: int = MAX_RESPONSES
) -> str | None:
    """Why :func:`evaluate_policy` cannot enumerate ``model`` on ``prompts``, or None when it can.

    The response space is (V−1)^T-sized (:func:`response_space_size`), V the model's vocabulary
    (``config.vocab_size``) and T the prompts' longest response limit, so only a model with the
    embedded task's own tiny tokenizer is enumerable; callers skip ``exact/*`` with this note
    instead of failing mid-run.
    """
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if not isinstance(vocab, int) or vocab < 2:
        return None  # unknown: enumerate_policy checks it on the logits
    T = max(_prompt_spec(item, max_new_tokens, digitsum.compute_score)[3] for item in prompts)
    n = response_space_size(vocab, T)
    if n <= max_responses:
        return None
    return (
        f"exact/* metrics skipped: the model's vocabulary of {vocab} tokens gives {n} responses of up to {T} tokens, "
        f"more than max_responses={max_responses}; exact enumeration needs the embedded task's own tokenizer (its "
        "reference, src/tether/tasks/assets/digitsum_ref); set data.train_files to train on other data"
    )


def _prompt_spec(item, max_new_tokens, reward_fn):
    """(prompt text, ground truth, extra_info, T) of a dataset row or a digit-sum prompt string."""
    if isinstance(item, str):
        k, s = digitsum.parse_prompt(item)
        gt, extra, text = f"{k},{s}", {"k": k, "s": s}, item
    elif isinstance(item, Mapping):
        if "prompt" not in item:
            raise ValueError(f"prompt row {item!r} has no 'prompt'")
        text = item["prompt"]
        if not isinstance(text, str):
            raise ValueError(f"prompt row has a non-text prompt {text!r}; exact evaluation needs plain text")
        gt = (item.get("reward_model") or {}).get("ground_truth")
        extra = item.get("extra_info")
        if gt is None:
            gt = ",".join(map(str, digitsum.parse_prompt(text)))
    else:
        raise ValueError(f"prompts must be dataset rows (dicts) or prompt strings, got {type(item).__name__}")
    if max_new_tokens is None:
        if reward_fn in (digitsum.compute_score, digitsum_hack.compute_score):
            max_new_tokens = digitsum.max_new_tokens_for(digitsum.parse_ground_truth(gt)[0])
        else:
            max_new_tokens = digitsum.MAX_NEW_TOKENS
    return text, gt, extra, max_new_tokens


def evaluate_prompts(
    policy,
    reference,
    tokenizer,
    prompts: Sequence[Mapping | str],
    beta: float,
    *,
    temperature: float = 1.0,
    max_new_tokens: int | None = None,
    reward_fn: Callable[..., float] = digitsum.compute_score,
    n_samples: int | None = None,
    ref_cache: dict | None = None,
    gold_fn: Callable[..., float] | None = None,
    reward_batch: Callable[[Mapping | str, list[str]], Sequence[float]] | None = None,
    gold_batch: Callable[[Mapping | str, list[str]], Sequence[float]] | None = None,
    score_cache: dict | None = None,
) -> list[dict[str, float]]:
    """:func:`evaluate_prompt` for each prompt; returns one dict per prompt (keys as there, plus
    ``s``/``k`` where the prompt is a digit-sum prompt).

    ``prompts``: dataset rows (``prompt``, ``reward_model.ground_truth``, ``extra_info``) or digit-sum
    prompt strings. ``max_new_tokens=None``: k + 1 for digit-sum prompts. Both models are enumerated
    at the same ``temperature``. ``ref_cache``: an optional dict, filled and reused, mapping
    ``(prompt, max_new_tokens, temperature)`` to the reference's :class:`ResponseSpace` (the reference
    is frozen, so sweeps need to enumerate it once). ``gold_fn``: a gold reward of the same signature when
    ``reward_fn`` is a proxy (adds the ``gold_*`` keys of :func:`evaluate_prompt`).

    ``reward_batch`` / ``gold_batch``: ``(prompt item, distinct response texts) -> scores``, one batched call per
    prompt in place of ``reward_fn`` / ``gold_fn`` per response (a user ``reward.function``, a reward model:
    :meth:`ResponseSpace.batch_rewards`); a NaN score (the reward could not score that response) counts 0, and
    ``unscored_mass`` / ``gold_unscored_mass`` is π's probability of such responses. ``reward_fn`` still decides
    the response limit (``max_new_tokens=None``). ``score_cache``: an optional dict, filled and reused, of the
    scores per ``(prompt, max_new_tokens, "reward" | "gold")`` (the rewards do not change during a run, so each
    response is scored once per run).
    """
    if len(prompts) == 0:
        raise ValueError("prompts is empty")
    results = []
    for item in prompts:
        text, gt, extra, T = _prompt_spec(item, max_new_tokens, reward_fn)
        key = (text, T, float(temperature))
        ref_space = ref_cache.get(key) if ref_cache is not None else None
        if ref_space is None:
            ref_space = enumerate_policy(reference, tokenizer, text, T, temperature)
            if ref_cache is not None:
                ref_cache[key] = ref_space
        pi_space = enumerate_policy(policy, tokenizer, text, T, temperature)
        spec = (item, gt, extra)
        rewards = _space_scores(ref_space, spec, "reward", reward_fn, reward_batch, score_cache)
        has_gold = gold_fn is not None or gold_batch is not None
        gold = _space_scores(ref_space, spec, "gold", gold_fn, gold_batch, score_cache) if has_gold else None
        res = evaluate_prompt(
            pi_space,
            ref_space,
            np.nan_to_num(rewards, nan=0.0),
            beta,
            n_samples=n_samples,
            gold=None if gold is None else np.nan_to_num(gold, nan=0.0),
        )
        if reward_batch is not None:
            res["unscored_mass"] = float(np.sum(pi_space.probs[np.isnan(rewards)]))
        if gold_batch is not None:
            res["gold_unscored_mass"] = float(np.sum(pi_space.probs[np.isnan(gold)]))
        try:
            res["k"], res["s"] = map(float, digitsum.parse_prompt(text))
        except ValueError:
            pass
        results.append(res)
    return results


def _space_scores(space: ResponseSpace, spec, which: str, fn, batch, cache: dict | None) -> np.ndarray:
    """The ``which`` ("reward" or "gold") scores of every response of ``space``: one ``batch(item, texts)`` call where
    given, else ``fn`` per distinct text; cached in ``cache`` by (prompt, T, which)."""
    item, gt, extra = spec
    key = (space.prompt, space.max_new_tokens, which)
    got = cache.get(key) if cache is not None else None
    if got is None:
        got = space.batch_rewards(lambda texts: batch(item, texts)) if batch else space.rewards(fn, gt, extra)
        if cache is not None:
            cache[key] = got
    return got


def evaluate_policy(
    policy,
    reference,
    tokenizer,
    prompts: Sequence[Mapping | str],
    beta: float,
    *,
    temperature: float = 1.0,
    max_new_tokens: int | None = None,
    reward_fn: Callable[..., float] = digitsum.compute_score,
    n_samples: int | None = None,
    ref_cache: dict | None = None,
    prefix: str = "exact/",
    gold_fn: Callable[..., float] | None = None,
    reward_batch: Callable[[Mapping | str, list[str]], Sequence[float]] | None = None,
    gold_batch: Callable[[Mapping | str, list[str]], Sequence[float]] | None = None,
    score_cache: dict | None = None,
) -> dict[str, float]:
    """Evaluate a trained policy against π_ref and the exact optimum π* over a list of prompts.

    Returns the mean over prompts of every key of :func:`evaluate_prompt`, each name prefixed with
    ``prefix`` (e.g. ``exact/kl_ref_tok``, ``exact/objective``, ``exact/opt_objective``,
    ``exact/kl_opt_seq``, ``exact/correct_effective_answers``), plus ``{prefix}n_prompts``. Arguments
    as in :func:`evaluate_prompts`. Costs two enumerations per prompt (one with a warm ``ref_cache``),
    about 0.2 s each for the shipped model on one core.
    """
    per = evaluate_prompts(
        policy,
        reference,
        tokenizer,
        prompts,
        beta,
        temperature=temperature,
        max_new_tokens=max_new_tokens,
        reward_fn=reward_fn,
        n_samples=n_samples,
        ref_cache=ref_cache,
        gold_fn=gold_fn,
        reward_batch=reward_batch,
        gold_batch=gold_batch,
        score_cache=score_cache,
    )
    keys = [k for k in per[0] if k not in ("k", "s")]
    out = {f"{prefix}{k}": float(np.mean([d[k] for d in per])) for k in keys}
    out[f"{prefix}n_prompts"] = float(len(per))
    return out
