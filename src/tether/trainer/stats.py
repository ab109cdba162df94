"""Per-step rollout metrics and validation (names as in DESIGN.md; units in docs/metrics.md)."""

from __future__ import annotations

import torch

from tether.algos import kl_penalty, masked_mean, trajectory_totals, zero_variance_groups
from tether.batch import RolloutBatch
from tether.evaluation.sampled import response_tokens, rows_where
from tether.metrics.diversity import diversity_metrics
from tether.rollout.agent import agent_metrics


def _mean(x: torch.Tensor) -> float:
    return float(x.float().mean()) if x.numel() else float("nan")


def _per_trajectory(x: torch.Tensor, traj: torch.Tensor) -> torch.Tensor:
    """(B',) per-row values -> (N',) their sums over each trajectory's rows (``traj`` (B',) its labels)."""
    _, index = torch.unique(traj.to(x.device), return_inverse=True)
    return torch.zeros(int(index.max()) + 1 if index.numel() else 0, dtype=x.dtype, device=x.device).index_add_(
        0, index, x
    )


def rollout_metrics(batch: RolloutBatch, *, beta: float, eos_id: int, pad_id: int, grouped: bool) -> dict[str, float]:
    """reward/*, kl/*, policy/entropy, response/*, rollout/*, diversity/* for one step's batch.

    Args:
        batch: the step's batch (scores, kl, old_logprobs, ref_logprobs, entropy set).
        beta: the current β, used only when ``batch.extra["kl_coef"]`` (the β that shaped this step's
            rewards / loss) is absent.
        eos_id, pad_id: the tokenizer's EOS and padding ids (truncation, diversity).
        grouped: the advantage estimator's baseline is the prompt's group (:data:`GROUP_ESTIMATORS`).
    """
    mask = batch.action_mask  # the model's tokens: per-token means of KL, entropy and log-probs run over these
    valid = batch.response_mask.sum(-1) > 0
    lengths = batch.response_mask.sum(-1).float()  # every response token, observations (multi-turn) included
    model_lengths = mask.sum(-1).float()
    per_tok = lambda x: masked_mean(x, mask, dim=-1)[valid]  # (B',) each counted response's token mean  # noqa: E731
    kl_seq = torch.where(mask.bool(), batch.kl, 0.0).sum(-1)[valid]
    beta = batch.extra.get("kl_coef", beta)  # the β that shaped this step's rewards / loss
    k1 = kl_penalty(batch.old_logprobs, batch.ref_logprobs, "k1", log_ratio_clamp=None)
    k3 = kl_penalty(batch.old_logprobs, batch.ref_logprobs, "k3")
    scores = batch.scores[valid]
    turn_sum = None if batch.turn_rewards is None else batch.turn_rewards.sum(-1)[valid].to(scores.dtype)
    traj = batch.extra.get("agent_trajectory")
    if traj is not None:  # agent.on_prefix_mismatch=split: reward/* and kl/ref_seq_mean per trajectory, pieces summed
        scores, kl_seq, turn_sum = (
            None if x is None else _per_trajectory(x, traj[valid.to(traj.device)]) for x in (scores, kl_seq, turn_sum)
        )
    eos = eos_id
    # no EOS: cut at rollout.max_new_tokens (every EOS id of the model, batch.truncated; the tokenizer's alone for a
    # hand-built batch)
    truncated = (
        batch.truncated.to(mask.device) if batch.truncated is not None else (batch.response_ids == eos).sum(-1) == 0
    )
    # multi-turn: the environment's per-turn rewards (batch.turn_rewards), summed per trajectory, beside the score
    m = {
        "reward/score_mean": _mean(scores),
        "reward/score_std": float(scores.std()) if scores.numel() > 1 else 0.0,
        "reward/rlhf_mean": _mean(scores + (0.0 if turn_sum is None else turn_sum) - beta * kl_seq),
        "kl/coef": beta,
        "kl/ref_mean": _mean(per_tok(batch.kl)),
        "kl/ref_seq_mean": _mean(kl_seq),
        "kl/ref_mean_unclamped": _mean(per_tok(k1)),
        "kl/k3_mean": _mean(per_tok(k3)),
        # None: old_logprobs_source=rollout
        "policy/entropy": _mean(per_tok(batch.entropy)) if batch.entropy is not None else float("nan"),
        "response/length_mean": _mean(lengths[valid]),
        "response/length_max": float(lengths.max()) if lengths.numel() else 0.0,
        "response/model_length_mean": _mean(model_lengths[valid]),
        "response/model_length_max": float(model_lengths.max()) if model_lengths.numel() else 0.0,
        "response/truncated_frac": _mean(truncated[valid].float()),
        "rollout/responses": float(len(batch)),
        "rollout/dropped_count": float((~valid).sum()),
        "ref/logprob_mean": _mean(per_tok(batch.ref_logprobs)),
        "ref/logprob_seq_mean": _mean(torch.where(mask.bool(), batch.ref_logprobs, 0.0).sum(-1)[valid]),
    }
    if turn_sum is not None:
        m["reward/turn_reward_mean"] = _mean(turn_sum)
    m |= kl_concentration_metrics(batch.kl, mask, batch.response_ids)
    m |= learning_signal_metrics(batch, grouped=grouped)
    if batch.values is not None:
        m["critic/values_mean"] = _mean(per_tok(batch.values))
        m["critic/returns_mean"] = _mean(per_tok(batch.returns))
    from_rollout = batch.extra.get("old_logprobs_metrics", {}).get("rollout/old_logprobs_from_rollout") == 1.0
    # old_logprobs := rollout_logprobs would read 0: nothing measured
    if batch.rollout_logprobs is not None and not from_rollout:
        m |= logprob_diff_metrics(batch.rollout_logprobs, batch.old_logprobs, mask)
    m |= batch.extra.get("reward_metrics", {})
    m |= batch.extra.get("sampling_metrics", {})  # algo.filter_groups (DAPO dynamic sampling)
    m |= batch.extra.get("old_logprobs_metrics", {})  # actor.old_logprobs_source=rollout
    m |= batch.extra.get("rollout_corr_metrics", {})  # algo.rollout_correction (Trainer.correct_rollout)
    m |= batch.extra.get("distill_metrics", {})  # distill.teacher (Trainer.apply_distill)
    m |= batch.extra.get("async_metrics", {})  # rollout.async_steps: rollout/staleness, rollout/stale_dropped
    # actor/entropy_coef; algo.mask_truncated, algo.top_entropy_quantile (Trainer.mask_tokens)
    m |= batch.extra.get("control_metrics", {})
    m |= agent_metrics(batch.extra.get("agent_totals", {}))  # agent.tools / agent.environment: agent/*
    keep = valid.tolist()  # diversity of the responses that counted (dropped samples are not the policy's output)
    if any(keep):
        pad = pad_id
        tokens = [t for t, k in zip(response_tokens(batch, eos), keep, strict=True) if k]
        groups = [g for g, k in zip(batch.group_ids.tolist(), keep, strict=True) if k]
        prompts = [p for p, k in zip(rows_where(batch.prompt_ids, batch.prompt_ids != pad), keep, strict=True) if k]
        m |= diversity_metrics(tokens, groups, prompts=prompts)
    return m


#: Below this many nats per counted token of positive KL, kl_concentration_metrics reports 0.0 (rounding noise).
KL_SHARE_FLOOR = 1e-5


def kl_concentration_metrics(kl: torch.Tensor, mask: torch.Tensor, token_ids: torch.Tensor) -> dict[str, float]:
    """Where one step's KL to the reference sits: on one response position, or on one token id.

    The KL estimate of every counted token (``kl``, (B, T), masked by ``mask``) is summed per response position t
    and, separately, per sampled token id; a sum below 0 (the k1 estimate of a token can be negative) counts as 0.
    ``kl/pos_top_share``: the largest position's share of the positive sums, in [1/T', 1] for T' positions with
    positive KL (1: all of the step's KL on one position, e.g. a hack that changes only the first token);
    ``kl/token_top_share``: the same by token id. Both 0.0 when the positive sums total at most
    :data:`KL_SHARE_FLOOR` nats per counted token (no KL, or a KL of rounding noise whose shares two code paths
    would not agree on). Read by the doctor's no-gold signals (``docs/hacking.md``); logging them changes nothing else.
    """
    k = torch.where(mask.bool(), kl.float(), 0.0)
    out = {}
    # a KL of rounding noise (step 1, where the policy is the reference) has no place it sits: its shares are noise
    floor = KL_SHARE_FLOOR * max(1.0, float(mask.bool().sum()))
    by_pos = k.sum(0).clamp(min=0.0)
    ids, inv = torch.unique(token_ids[mask.bool()], return_inverse=True)
    by_tok = torch.zeros(ids.numel(), dtype=k.dtype, device=k.device).index_add_(0, inv, k[mask.bool()])
    for name, sums in (("kl/pos_top_share", by_pos), ("kl/token_top_share", by_tok.clamp(min=0.0))):
        total = float(sums.sum()) if sums.numel() else 0.0
        out[name] = float(sums.max()) / total if total > floor else 0.0
    return out


GROUP_ESTIMATORS = ("grpo", "drgrpo", "rloo", "reinforce_plus_plus_baseline")
"""Advantage estimators whose baseline is the prompt's group (a group of equal scores gives 0)."""


def learning_signal_metrics(batch: RolloutBatch, *, grouped: bool = True) -> dict[str, float]:
    """What the doctor's ``no_learning_signal`` check reads.

    ``rollout/zero_var_group_frac`` (only when ``grouped``: a group-relative estimator, see
    :data:`GROUP_ESTIMATORS`): the fraction of the batch's prompts (groups with a counted response)
    whose counted responses all got the same reward, or that have a single one: they give every
    group-relative advantage exactly 0 (all wrong or all right). The reward compared is the one the
    advantages see: the score plus, in a multi-turn run, the trajectory's per-turn rewards
    (``batch.turn_rewards`` summed). ``advantages/abs_mean``: the mean |advantage| over counted tokens
    (0 = nothing to learn from this batch).
    """
    valid = batch.response_mask.sum(-1) > 0  # (B,)
    out = {}
    if grouped and batch.scores is not None and bool(valid.any()):
        scores, mask, group_ids = batch.scores, batch.response_mask, batch.group_ids
        if batch.turn_rewards is not None:  # the environment's per-turn rewards count as the score does
            scores = scores + batch.turn_rewards.sum(-1).to(scores.dtype)
        if "agent_trajectory" in batch.extra:  # agent.on_prefix_mismatch=split: a trajectory is one member
            scores, mask, group_ids, _ = trajectory_totals(scores, mask, group_ids, batch.extra["agent_trajectory"])
            valid = mask[:, 0]
        flat = zero_variance_groups(scores, mask, group_ids)[valid]  # (B',)
        groups, first = torch.unique(group_ids[valid], return_inverse=True)
        # (G,)
        flat_group = torch.zeros(groups.numel(), dtype=torch.bool, device=flat.device).index_put_((first,), flat)
        out["rollout/zero_var_group_frac"] = float(flat_group.float().mean())
    if batch.advantages is not None and bool(valid.any()):
        out["advantages/abs_mean"] = float(masked_mean(batch.advantages.abs(), batch.action_mask))
    return out


def logprob_diff_metrics(
    rollout_logprobs: torch.Tensor, old_logprobs: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, float]:
    """The training–inference mismatch of one step: how far the rollout engine's log-probs of the
    sampled tokens are from the trainer's recomputed ones, on the same weights.

    Args:
        rollout_logprobs: (B, T) the engine's log π(a_t|s_t) (vLLM's), nats; NaN where unknown.
        old_logprobs: (B, T) the actor's log π_old(a_t|s_t) from its own forward pass, nats.
        response_mask: (B, T) 1 = the token counts.
    Returns:
        ``rollout/logprob_diff_mean``: mean of |rollout − old| over every counted token with a known
        engine log-prob (a token mean over the whole batch, not per response), nats;
        ``rollout/logprob_diff_max``: its maximum, nats. Both NaN when no token qualifies. (verl logs
        the same comparison on probabilities as ``training/rollout_probs_diff_*``.)
    """
    diff = (rollout_logprobs.to(old_logprobs.device).float() - old_logprobs.float()).abs()
    keep = response_mask.bool() & torch.isfinite(diff)
    if not bool(keep.any()):
        return {"rollout/logprob_diff_mean": float("nan"), "rollout/logprob_diff_max": float("nan")}
    return {"rollout/logprob_diff_mean": float(diff[keep].mean()), "rollout/logprob_diff_max": float(diff[keep].max())}
