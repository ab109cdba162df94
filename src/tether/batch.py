"""The rollout batch: the transport object of a training step, below both the trainer and the workers.

One typed object carried through every phase; workers (local or remote) read and return it, so it
imports nothing above `tether.data`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import torch

from tether.data import PromptRow


@dataclass
class RolloutBatch:
    """B responses of padded length T to prompts left-padded to length P.

    Tensor fields (all on the trainer's device):
        prompt_ids (B, P) int64, left-padded; prompt_mask (B, P) 1 = real prompt token.
        response_ids (B, T) int64, right-padded; response_mask (B, T) 1 = the token counts
            (response tokens up to and including EOS; 0 for padding and for dropped samples).
        generated_mask (B, T) int64: 1 where the model sampled the token, 0 where anything else put it (a
            multi-turn episode's tool outputs) and on padding; the rollout runner sets it and ``loss_mask``
            starts from it. Single-turn: equal to ``response_mask`` as rolled out. None = a batch built by hand
            (every response token then counts as generated).
        old_logprobs, ref_logprobs (B, T): log π_old(a_t|s_t), log π_ref(a_t|s_t), nats.
        teacher_logprobs (B, T): log π_teacher(a_t|s_t) of the sampled tokens under ``distill.teacher`` (at
            rollout.temperature, as the others), nats; None = distillation off.
        entropy (B, T): entropy of π_old at each position, nats.
        values (B, T): critic V(s_t) (gae only).
        scores (B,): sequence reward; token_level_rewards (B, T): scores at the last model token
            minus β·KL per model token (placement reward/both), plus ``turn_rewards``.
        turn_rewards (B, T): per-turn rewards of a multi-turn episode, each at its turn's last model token
            (:func:`tether.algos.place_turn_rewards`), 0 elsewhere; None = the episode's score alone.
        kl (B, T): the per-token KL to the reference by the configured estimator, nats.
        advantages, returns (B, T).
        group_ids (B,) int64: which prompt each response answers.
        rollout_logprobs (B, T): log-probs of the sampled tokens as the rollout engine computed them
            (vLLM, or the HF engine when asked: actor.old_logprobs_source=rollout or
            algo.rollout_correction), nats, NaN where unknown; None when the engine returns none.
        is_weights (B, T): rollout-correction weights π_old/π_rollout after truncation or masking,
            detached, multiplying each token's policy loss and KL term; 0 at rejected tokens; None =
            no correction (``tether.algos.rollout_correction``).
        loss_mask (B, T) bool: the tokens the actor trains on: ``generated_mask`` as rolled out, less what
            rollout correction's rejection and ``algo.mask_truncated`` take out; the actor's loss and its
            token counts use ``response_mask & loss_mask`` (:attr:`update_mask`); None = all of them.
        truncated (B,) bool: the response has no EOS (it was cut at rollout.max_new_tokens, or for an
            offline row at that length); None = not known (a batch built by hand).
        entropy_mask (B, T) bool: ``algo.top_entropy_quantile``: the tokens among the step's highest-entropy
            fraction (``tether.algos.top_entropy_mask`` of π_old's entropy over the whole batch), the only
            ones whose policy loss counts (the KL and entropy terms keep every token); None = all.
    Non-tensor fields: rows (the B dataset rows), prompts/responses (decoded text), finish_reasons (B
        strings, ``tether.rollout.engine.FINISH_REASONS``: why each response ended; None = not known).
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    response_ids: torch.Tensor
    response_mask: torch.Tensor
    group_ids: torch.Tensor
    rows: list[PromptRow]
    prompts: list[str]
    responses: list[str]
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    teacher_logprobs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    values: torch.Tensor | None = None
    scores: torch.Tensor | None = None
    kl: torch.Tensor | None = None
    token_level_rewards: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    rollout_logprobs: torch.Tensor | None = None
    is_weights: torch.Tensor | None = None
    loss_mask: torch.Tensor | None = None
    truncated: torch.Tensor | None = None
    entropy_mask: torch.Tensor | None = None
    generated_mask: torch.Tensor | None = None
    turn_rewards: torch.Tensor | None = None
    finish_reasons: list[str] | None = None
    extra: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return self.response_ids.shape[0]

    @property
    def input_ids(self) -> torch.Tensor:
        """(B, P+T) prompt and response ids."""
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:
        """(B, P+T): real prompt tokens and counted response tokens."""
        return torch.cat([self.prompt_mask, self.response_mask], dim=1)

    @property
    def update_mask(self) -> torch.Tensor:
        """(B, T) the tokens the actor's loss counts: ``response_mask`` times ``loss_mask`` (the generated tokens,
        less those rollout correction rejected and ``algo.mask_truncated`` took out)."""
        if self.loss_mask is None:
            return self.response_mask
        return self.response_mask * self.loss_mask.to(device=self.response_mask.device, dtype=self.response_mask.dtype)

    @property
    def action_mask(self) -> torch.Tensor:
        """(B, T) the model's own tokens among the counted ones: ``response_mask`` times ``generated_mask`` (all of
        ``response_mask`` when ``generated_mask`` is None). The KL to the reference, the rewards and returns, and the
        per-token means of KL, entropy and log-probs run over these: a token the environment appended (a tool's
        output) is not an action of the policy. Unlike :attr:`update_mask` it keeps tokens that rollout correction
        rejected or ``algo.mask_truncated`` took out of the loss: those are still the policy's actions, and their KL
        is still part of the trajectory's. Single-turn it equals ``response_mask``."""
        if self.generated_mask is None:
            return self.response_mask
        g = self.generated_mask.to(device=self.response_mask.device, dtype=self.response_mask.dtype)
        return self.response_mask * g

    @property
    def response_lengths(self) -> torch.Tensor:
        """(B,) valid response tokens per row, tokens."""
        return self.response_mask.sum(-1)

    def select(self, idx: torch.Tensor | list[int]) -> RolloutBatch:
        """The sub-batch of rows ``idx`` (tensor fields indexed on dim 0)."""
        idx_t = torch.as_tensor(idx, dtype=torch.long)
        idx_l = idx_t.tolist()
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor):
                out[f.name] = v.index_select(0, idx_t.to(v.device))
            elif isinstance(v, list):
                out[f.name] = [v[i] for i in idx_l]
            else:
                out[f.name] = v
        return replace(self, **out)

    @staticmethod
    def concat(batches: list[RolloutBatch], pad_id: int = 0) -> RolloutBatch:
        """The rows of ``batches`` in order, as one batch (DAPO's dynamic sampling gathers draws).

        Prompts are left-padded with ``pad_id`` (mask 0) to the longest P, (B, T) fields right-padded
        with 0 (response_ids with ``pad_id``; mask 0) to the longest T; ``group_ids`` are renumbered
        so that groups of different batches never merge. ``extra`` is the first batch's. A field
        must be set in every batch or in none.

        Raises:
            ValueError: no batch, or a field set in some batches only.
        """
        if not batches:
            raise ValueError("RolloutBatch.concat needs at least one batch")
        P = max(b.prompt_ids.shape[1] for b in batches)
        T = max(b.response_ids.shape[1] for b in batches)
        out: dict = {}
        for f in fields(RolloutBatch):
            vals = [getattr(b, f.name) for b in batches]
            if f.name == "extra":
                out[f.name] = dict(vals[0])
            elif all(v is None for v in vals):
                out[f.name] = None
            elif any(v is None for v in vals):
                raise ValueError(f"RolloutBatch.concat: {f.name} is set in some batches only")
            elif isinstance(vals[0], list):
                out[f.name] = [x for v in vals for x in v]
            elif f.name == "group_ids":
                parts, offset = [], 0
                for v in vals:  # renumber 0..G-1 per batch, then shift past the previous batches' groups
                    _, dense = torch.unique(v, return_inverse=True)
                    parts.append(dense + offset)
                    offset += int(dense.max()) + 1 if dense.numel() else 0
                out[f.name] = torch.cat(parts)
            elif vals[0].dim() == 1:
                out[f.name] = torch.cat(vals)
            elif f.name in ("prompt_ids", "prompt_mask"):
                fill = pad_id if f.name == "prompt_ids" else 0
                out[f.name] = torch.cat([torch.nn.functional.pad(v, (P - v.shape[1], 0), value=fill) for v in vals])
            else:
                fill = pad_id if f.name == "response_ids" else 0
                out[f.name] = torch.cat([torch.nn.functional.pad(v, (0, T - v.shape[1]), value=fill) for v in vals])
        return RolloutBatch(**out)

    def drop(self, rows: torch.Tensor) -> None:
        """Drop samples in place: their response_mask becomes 0, so no loss, statistic or group sees them.

        Args:
            rows: (B,) bool, True = drop.
        """
        self.response_mask = self.response_mask * (~rows.to(self.response_mask.device)).unsqueeze(1).to(
            self.response_mask.dtype
        )
