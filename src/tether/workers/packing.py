"""Micro-batches sized by a token budget, and the padding-free (packed) forward of a micro-batch.

Two independent choices (``actor.*`` / ``critic.*`` keys of the same names):

* ``max_tokens_per_micro_batch`` (verl's dynamic batch size, ``ppo_max_token_len_per_gpu``): rows of
  a (mini-)batch are sorted by their valid tokens (prompt + response) and packed greedily into
  micro-batches whose cost stays within the budget; the row count ``micro_batch_size`` is then not
  used. The cost of a micro-batch is what its forward processes: rows × (longest prompt + longest
  response) in the padded layout (leading all-padding prompt columns are trimmed too), the sum of
  valid tokens in the padding-free one (see :func:`token_budget_groups` for the grouping). A row
  longer than the budget runs alone. Results are
  scattered back to the rows' original order. The loss is unchanged by any split, because
  ``agg_loss`` divides by the whole mini-batch's token and sequence counts.
* ``padding_free`` (verl's ``use_remove_padding``): the valid tokens of the micro-batch's
  sequences (all but each one's last response token, which is only scored, never an input) are packed into rows
  (first-fit decreasing, each row at most as long as the longest
  sequence, so attention costs O(row²) per row, never O(total²)), with position ids restarting at 0
  for each sequence and no attention mask. Hugging Face transformers (>= 4.56,
  ``masking_utils.find_packed_sequence_indices``) detects the restarts and builds a block-diagonal
  causal mask, so attention never crosses sequences; the LM head runs only on the positions that
  score a response token (``logits_to_keep`` as a boolean (R, L) mask). Log-probs, entropy, KL and
  values come back in the (B, T) layout, 0 where ``response_mask`` is 0.

``actor.share_prompt_prefix`` (:mod:`tether.models.prefix`) is what the padded layout's forward does
when it is on: each distinct prompt of the micro-batch runs once, whichever way the rows were grouped
(so it composes with a token budget; a budget's length-sorted groups keep fewer of a prompt's
responses together than consecutive rows do). It is not combined with ``padding_free`` (refused at
config time and by :class:`MicroBatching`): packed rows hold whole sequences, with no KV cache to share.

Every rank of a data-parallel group must run the same number of forwards (FSDP2 all-gathers the
parameters in each): ``dp.micro_batch_count`` is the largest count over the ranks, and a rank with
fewer micro-batches runs empty ones (one row whose ``response_mask`` is 0: no loss, no gradient).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from tether.algos import distill_divergence, logprobs_and_entropy_from_logits
from tether.algos import kl_full as _kl_full
from tether.batch import RolloutBatch
from tether.models import response_logprobs
from tether.models.forward import _forward_params, autocast
from tether.models.prefix import micro_batch_logprobs, micro_batch_values
from tether.models.vocab_parallel import kl_full, logprobs_from_logits
from tether.workers.common import trim


@dataclass(frozen=True)
class MicroBatching:
    """How a worker splits a (mini-)batch into micro-batches and lays each out for the model.

    Attributes:
        size: responses per micro-batch (``micro_batch_size``), used when ``max_tokens`` is None.
        max_tokens: token budget per micro-batch (``max_tokens_per_micro_batch``), tokens; None = by row count.
        padding_free: pack the valid tokens of several sequences into one row (``padding_free``).
        share_prefix: the padded layout runs each distinct prompt once (``actor.share_prompt_prefix``).

    Raises:
        ValueError: ``share_prefix`` with ``padding_free``.
    """

    size: int
    max_tokens: int | None = None
    padding_free: bool = False
    share_prefix: bool = False

    def __post_init__(self) -> None:
        if self.share_prefix and self.padding_free:
            raise ValueError(
                "share_prompt_prefix cannot be combined with padding_free (packed rows hold whole sequences); turn one "
                "off"
            )

    def split(
        self, batch: RolloutBatch, dp=None
    ) -> Iterator[tuple[torch.Tensor, RolloutBatch, PaddedLayout | PackedLayout]]:
        """(row indices (b,) into ``batch``, micro-batch, its layout) for each micro-batch.

        With a token budget and ``dp`` (a worker's data-parallel hooks), the count is padded to
        ``dp.micro_batch_count`` with empty micro-batches, whose row indices are empty.
        """
        groups = self.groups(batch)
        if self.max_tokens is not None and dp is not None and len(batch):
            groups += [torch.empty(0, dtype=torch.long)] * (dp.micro_batch_count(len(groups)) - len(groups))
        for idx in groups:
            mb = batch.select(idx) if len(idx) else empty_micro_batch(batch)
            yield idx, mb, self.layout(mb)

    def groups(self, batch: RolloutBatch) -> list[torch.Tensor]:
        """Row indices of each micro-batch: consecutive runs of ``size`` rows, or token-budget groups."""
        n = len(batch)
        if self.max_tokens is None:
            return [torch.arange(s, min(s + self.size, n)) for s in range(0, n, self.size)]
        return [
            torch.as_tensor(g, dtype=torch.long)
            for g in token_budget_groups(batch, self.max_tokens, padding_free=self.padding_free)
        ]

    def layout(self, mb: RolloutBatch) -> PaddedLayout | PackedLayout:
        if self.padding_free:
            return PackedLayout.of(mb)
        return PaddedLayout.of(mb, trim_prompt=self.max_tokens is not None, share_prefix=self.share_prefix)


def check_padding_free(model, key: str = "actor.padding_free") -> None:
    """Refuse a model whose forward would let packed sequences attend to each other.

    Packing relies on Hugging Face's own model code building the mask from restarting position ids
    (``transformers.masking_utils.find_packed_sequence_indices``, transformers >= 4.56); custom
    (remote) model code or an older transformers gives no such guarantee.

    Raises:
        ValueError: names ``key``, the model class and what is missing.
    """
    import transformers.masking_utils as masking_utils

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base = getattr(base, "backbone", base)  # the critic's ValueModel
    cls = type(base)
    if not hasattr(masking_utils, "find_packed_sequence_indices"):
        raise ValueError(
            f"{key}=true needs transformers >= 4.56 (packed-sequence masks); this one has none; set {key}=false"
        )
    # FSDP2 subclasses the model's class
    if not any(c.__module__.startswith("transformers.models.") for c in cls.__mro__):
        raise ValueError(
            f"{key}=true supports Hugging Face's own model classes only ({cls.__module__}.{cls.__name__} is custom "
            f"code, which may let packed sequences attend to each other); set {key}=false"
        )


def token_budget_groups(batch: RolloutBatch, max_tokens: int, *, padding_free: bool) -> list[list[int]]:
    """Row indices of micro-batches within ``max_tokens`` each (verl's dynamic batch size).

    Padded layout: rows in decreasing order of valid tokens (prompt + response; ties: lower index
    first) join the current micro-batch while rows × (longest prompt + longest response) stays
    within the budget, so rows of similar length share a micro-batch and little is padding.
    Padding-free: the fewest k >= ceil(valid tokens / budget) micro-batches that the rows, in that
    order, each put into the least-loaded one (Graham's LPT; ties: the lower one), fit within the
    budget; each micro-batch gets long and short rows alike, which pack densely into rows.
    A row over the budget on its own runs alone. Deterministic; indices within a micro-batch are
    in the sorted order.

    Raises:
        ValueError: ``max_tokens`` < 1.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens_per_micro_batch must be >= 1 token, got {max_tokens}")
    plen = batch.prompt_mask.sum(-1).tolist()
    rlen = batch.response_mask.sum(-1).tolist()
    tokens = [p + r for p, r in zip(plen, rlen, strict=True)]
    order = sorted(range(len(batch)), key=lambda i: (-tokens[i], i))
    if padding_free:
        return _balanced_groups(order, tokens, max_tokens)
    groups: list[list[int]] = []
    cur: list[int] = []
    max_p = max_r = 0
    for i in order:
        cost = (len(cur) + 1) * (max(max_p, plen[i]) + max(max_r, rlen[i]))
        if cur and cost > max_tokens:
            groups.append(cur)
            cur, max_p, max_r = [], 0, 0
        cur.append(i)
        max_p, max_r = max(max_p, plen[i]), max(max_r, rlen[i])
    if cur:
        groups.append(cur)
    return groups


def _balanced_groups(order: list[int], tokens: list[int], max_tokens: int) -> list[list[int]]:
    k = max(1, -(-sum(tokens) // max_tokens))
    while True:
        loads, groups = [0] * k, [[] for _ in range(k)]
        for i in order:
            g = min(range(k), key=lambda g: (loads[g], g))
            if loads[g] and loads[g] + tokens[i] > max_tokens:
                break
            groups[g].append(i)
            loads[g] += tokens[i]
        else:
            return [g for g in groups if g]
        k += 1


def empty_micro_batch(batch: RolloutBatch) -> RolloutBatch:
    """Row 0 of ``batch`` with ``response_mask`` 0: a forward that adds no loss, count or gradient."""
    mb = batch.select([0])
    mb.response_mask = torch.zeros_like(mb.response_mask)
    return mb


def _lm_outputs(model, ids, mask, t, temperature, with_entropy, return_logits, compute_dtype):
    return response_logprobs(
        model,
        ids,
        mask,
        t,
        temperature=temperature,
        with_entropy=with_entropy,
        return_logits=return_logits,
        compute_dtype=compute_dtype,
    )


@dataclass
class PaddedLayout:
    """A micro-batch as (b, P'+t) rows: prompt left-padded, response right-padded (today's layout).

    Attributes: ids, mask (b, P'+t); t, the response columns kept (the longest response, >= 1);
    mb, the micro-batch, set when its forwards share each distinct prompt (:mod:`tether.models.prefix`).
    """

    ids: torch.Tensor
    mask: torch.Tensor
    t: int
    mb: RolloutBatch | None = None

    @classmethod
    def of(cls, mb: RolloutBatch, *, trim_prompt: bool = False, share_prefix: bool = False) -> PaddedLayout:
        ids, mask, t = trim(mb)
        if trim_prompt:  # leading columns that are padding in every row change nothing but the cost
            p = mb.prompt_ids.shape[1]
            lead = int((mb.prompt_mask.sum(0) == 0).long().cumprod(0).sum()) if p else 0
            lead = min(lead, p - 1) if p else 0
            ids, mask = ids[:, lead:], mask[:, lead:]
        return cls(ids, mask, t, mb if share_prefix else None)

    def logprobs(
        self,
        model,
        *,
        temperature: float,
        with_entropy: bool = False,
        return_logits: bool = False,
        compute_dtype: str = "float32",
    ):
        """(logprobs (b, t), entropy (b, t) or None, logits (b, t, V) or None); see ``tether.models.response_logprobs``
        (``tether.models.prefix.micro_batch_logprobs`` when the layout shares prompts)."""
        if self.mb is not None:
            return micro_batch_logprobs(
                model,
                self.mb,
                self.ids,
                self.mask,
                self.t,
                share_prefix=True,
                temperature=temperature,
                with_entropy=with_entropy,
                return_logits=return_logits,
                compute_dtype=compute_dtype,
            )
        return _lm_outputs(model, self.ids, self.mask, self.t, temperature, with_entropy, return_logits, compute_dtype)

    def token_logprobs(self, logits: torch.Tensor, temperature: float) -> torch.Tensor:
        """(b, t) log-probs of the response tokens from this layout's (b, t, V) logits, nats."""
        return logprobs_from_logits(logits, self.ids[:, -self.t :], temperature)

    def kl_full(self, logits: torch.Tensor, ref_logits: torch.Tensor, temperature: float) -> torch.Tensor:
        """(b, t) exact KL(π‖π_ref) per token from two (b, t, V) logits, nats."""
        return kl_full(logits, ref_logits, temperature=temperature)

    def distill_divergence(self, logits: torch.Tensor, teacher_logits: torch.Tensor, **kwargs) -> torch.Tensor:
        """(b, t) :func:`tether.algos.distill_divergence` per token from two (b, t, V) logits, nats."""
        return distill_divergence(logits, teacher_logits, **kwargs)

    def values(self, model) -> torch.Tensor:
        """(b, t) V(s_t) from a ``ValueModel`` (``tether.models.prefix.micro_batch_values`` when the layout shares
        prompts)."""
        if self.mb is not None:
            return micro_batch_values(model, self.mb, self.ids, self.mask, self.t, share_prefix=True)
        return model(self.ids, self.mask, self.t)


@dataclass
class PackedLayout:
    """A micro-batch's valid tokens packed into (R, L) rows, each holding whole sequences (without
    their last response token: its logits would predict past the response, and nothing attends to it).

    Attributes:
        input_ids, position_ids: (R, L); positions restart at 0 per sequence (a row's unused tail
            is a dummy sequence of token 0 that nothing reads).
        keep: (R, L) bool, True at the N positions whose logits score a response token (the
            position before it), in row-major order.
        targets: (N,) the flat index b·t + j into (b, t) of the response token each kept position scores.
        token_ids: (N,) those response tokens.
        b, t: rows of the micro-batch and its longest response (>= 1), tokens.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    keep: torch.Tensor
    targets: torch.Tensor
    token_ids: torch.Tensor
    b: int
    t: int

    @classmethod
    def of(cls, mb: RolloutBatch) -> PackedLayout:
        """Pack ``mb``'s valid tokens (first-fit decreasing into rows as long as its longest sequence).

        Raises:
            ValueError: a row whose prompt_mask is not left padding or whose response_mask is not a
                prefix (a hole), or a row with response tokens but no prompt token; names the row.
        """
        plen = mb.prompt_mask.sum(-1)
        rlen = mb.response_mask.sum(-1)
        P, T = mb.prompt_ids.shape[1], mb.response_ids.shape[1]
        t = max(int(rlen.max()) if len(rlen) else 0, 1)
        _check_contiguous(mb, plen, rlen, P, T)
        # each sequence's last response token is only scored, never an input (its logits would predict past the
        # response)
        lengths = (plen + (rlen - 1).clamp(min=0)).tolist()
        cap = max(max(lengths), 1)
        rows: list[list[int]] = []
        fill: list[int] = []
        for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
            r = next((r for r in range(len(rows)) if fill[r] + lengths[i] <= cap), None)
            if r is None:
                rows.append([])
                fill.append(0)
                r = len(rows) - 1
            rows[r].append(i)
            fill[r] += lengths[i]
        L = max(fill)
        dev = mb.prompt_ids.device
        input_ids = torch.zeros(len(rows), L, dtype=mb.prompt_ids.dtype, device=dev)
        position_ids = torch.zeros(len(rows), L, dtype=torch.long, device=dev)
        keep = torch.zeros(len(rows), L, dtype=torch.bool, device=dev)
        target = torch.zeros(len(rows), L, dtype=torch.long, device=dev)
        for r, seqs in enumerate(rows):
            off = 0
            for i in seqs:
                p, n = int(plen[i]), int(rlen[i])
                m = p + max(n - 1, 0)  # the tokens fed: the prompt and all but the last response token
                input_ids[r, off : off + p] = mb.prompt_ids[i, P - p :]
                input_ids[r, off + p : off + m] = mb.response_ids[i, : m - p]
                position_ids[r, off : off + m] = torch.arange(m, device=dev)
                keep[r, off + p - 1 : off + p - 1 + n] = True
                target[r, off + p - 1 : off + p - 1 + n] = i * t + torch.arange(n, device=dev)
                off += m
            position_ids[r, off:] = torch.arange(L - off, device=dev)
        targets = target[keep]
        token_ids = mb.response_ids[:, :t].reshape(-1)[targets]
        return cls(input_ids, position_ids, keep, targets, token_ids, len(mb), t)

    def scatter(self, x: torch.Tensor) -> torch.Tensor:
        """(N,) values at the kept positions -> (b, t), 0 elsewhere (differentiable)."""
        out = x.new_zeros(self.b * self.t)
        return out.index_copy(0, self.targets, x).view(self.b, self.t)

    def _logits(self, model, compute_dtype: str) -> torch.Tensor:
        """(N, V) logits at the kept positions."""
        kwargs = {"logits_to_keep": self.keep} if "logits_to_keep" in _forward_params(model) else {}
        with autocast(self.input_ids.device, compute_dtype):
            out = model(
                input_ids=self.input_ids, position_ids=self.position_ids, attention_mask=None, use_cache=False, **kwargs
            )
        logits = out.logits
        if logits.dim() == 3:  # a model that ignores a boolean logits_to_keep: every position's logits
            logits = logits[self.keep]
        if type(logits).__name__ == "DTensor":
            raise ValueError("padding_free does not support tensor parallelism (actor.tp_size > 1)")
        return logits

    def logprobs(
        self,
        model,
        *,
        temperature: float,
        with_entropy: bool = False,
        return_logits: bool = False,
        compute_dtype: str = "float32",
    ):
        """(logprobs (b, t), entropy (b, t) or None, logits (N, V) or None), nats; as the padded layout's,
        with 0 where the response mask is 0."""
        logits = self._logits(model, compute_dtype)
        lp, ent = logprobs_and_entropy_from_logits(logits, self.token_ids, temperature, with_entropy=with_entropy)
        return self.scatter(lp), (self.scatter(ent) if with_entropy else None), (logits if return_logits else None)

    def token_logprobs(self, logits: torch.Tensor, temperature: float) -> torch.Tensor:
        """(b, t) log-probs of the response tokens from this layout's (N, V) logits, nats."""
        return self.scatter(
            logprobs_and_entropy_from_logits(logits, self.token_ids, temperature, with_entropy=False)[0]
        )

    def kl_full(self, logits: torch.Tensor, ref_logits: torch.Tensor, temperature: float) -> torch.Tensor:
        """(b, t) exact KL(π‖π_ref) per token from two (N, V) logits, nats."""
        return self.scatter(_kl_full(logits, ref_logits, temperature=temperature))

    def distill_divergence(self, logits: torch.Tensor, teacher_logits: torch.Tensor, **kwargs) -> torch.Tensor:
        """(b, t) :func:`tether.algos.distill_divergence` per token from two (N, V) logits, nats."""
        return self.scatter(distill_divergence(logits, teacher_logits, **kwargs))

    def values(self, model) -> torch.Tensor:
        """(b, t) V(s_t) from a ``ValueModel`` (its packed forward)."""
        return self.scatter(model(self.input_ids, None, self.t, position_ids=self.position_ids, keep=self.keep))


def _check_contiguous(mb: RolloutBatch, plen: torch.Tensor, rlen: torch.Tensor, P: int, T: int) -> None:
    cols_p = torch.arange(P, device=plen.device)
    cols_r = torch.arange(T, device=rlen.device)
    left_padded = (mb.prompt_mask.bool() == (cols_p[None] >= P - plen[:, None])).all(-1)
    prefix = (mb.response_mask.bool() == (cols_r[None] < rlen[:, None])).all(-1)
    bad = (~(left_padded & prefix)) | ((plen == 0) & (rlen > 0))
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise ValueError(
            "padding_free needs each row's prompt left-padded (prompt_mask 0…0 1…1), its response_mask a prefix (1…1 "
            f"0…0) and at least one prompt token; row {i} has prompt_mask {mb.prompt_mask[i].tolist()} and "
            f"response_mask {mb.response_mask[i].tolist()}"
        )
