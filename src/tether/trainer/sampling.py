"""DAPO's dynamic sampling (``algo.filter_groups``): keep drawing prompts until enough groups differ in reward.

A prompt whose ``rollout.n`` responses all get the same reward (all wrong, or all right) has zero
group-relative advantage, so it adds nothing to the policy gradient but still dilutes the batch.
Yu et al. 2025 (DAPO, sec. 3.2, eq. 11: ``0 < |{o_i correct}| < G``) over-sample and drop such
groups until the batch is full; verl's DAPO recipe does the same with a cap on generation rounds
(``max_num_gen_batches``). tether caps the rounds at ``algo.filter_groups_max_draws``; when the cap
is reached it trains on the informative groups found (or, with none, on the last draw, whose
rewards then carry no comparison) and says so, rather than stopping the run.

Each round draws ``data.batch_size`` prompts from the same :class:`~tether.data.loading.PromptSampler`,
so the sampler's position (checkpointed) covers every prompt drawn and a resumed run draws the
same prompts again.
"""

from __future__ import annotations

import logging

import torch

from tether.algos import zero_variance_groups
from tether.batch import RolloutBatch

log = logging.getLogger("tether")


def _merge_reward_metrics(parts: list[dict]) -> dict[str, float]:
    """One step's reward metrics from several draws: ``*_count`` summed, ``reward/all_invalid`` the
    product (1 only if every draw was all invalid), everything else the mean over draws."""
    keys = dict.fromkeys(k for p in parts for k in p)
    out = {}
    for k in keys:
        vals = [p[k] for p in parts if k in p]
        if k.endswith("_count"):
            out[k] = float(sum(vals))
        elif k == "reward/all_invalid":
            out[k] = float(all(v == 1.0 for v in vals))
        else:
            out[k] = float(sum(vals) / len(vals))
    return out


def dynamic_sample(rollout, score, timer, *, batch_size: int, max_draws: int, pad_id: int, step: int) -> RolloutBatch:
    """Rollout + reward rounds until ``batch_size`` (``data.batch_size``) prompts have rewards that differ.

    Args:
        rollout: draws a batch (``Trainer.rollout``); score: sets its scores, dropping bad samples
            (``Trainer.score``); timer: the step's PhaseTimer (``rollout`` and ``reward`` phases).
        max_draws: ``algo.filter_groups_max_draws``; pad_id: the tokenizer's; step: for the warning.

    Returns the batch of the first ``batch_size`` informative groups in draw order, with
    ``extra["sampling_metrics"]``: ``rollout/draws`` (rounds), ``rollout/prompts_drawn`` (prompts
    sampled over all rounds), ``rollout/filtered_groups`` (groups dropped for zero reward
    variance), ``rollout/filter_exhausted`` (1 when the cap ended the search short of a full batch).
    """
    want, cap = batch_size, max_draws
    kept: list[RolloutBatch] = []
    rewards: list[dict] = []
    n_kept = drawn = filtered = draws = 0
    last = None
    while n_kept < want and draws < cap:
        with timer("rollout"):
            batch = rollout()
        with timer("reward"):
            score(batch)
        draws += 1
        rewards.append(batch.extra.get("reward_metrics", {}))
        flat = zero_variance_groups(batch.scores, batch.response_mask, batch.group_ids)  # (B,)
        groups = batch.group_ids.unique()
        good = batch.group_ids[~flat].unique()
        drawn += groups.numel()
        filtered += groups.numel() - good.numel()
        good = good[: want - n_kept]  # (G',) the groups still needed, in draw order
        if good.numel():
            kept.append(batch.select(torch.isin(batch.group_ids, good).nonzero().squeeze(1).tolist()))
            n_kept += good.numel()
        last = batch
    exhausted = n_kept < want
    out = RolloutBatch.concat(kept, pad_id=pad_id) if kept else last
    out.extra["reward_metrics"] = _merge_reward_metrics(rewards)
    out.extra["sampling_metrics"] = {
        "rollout/draws": float(draws),
        "rollout/prompts_drawn": float(drawn),
        "rollout/filtered_groups": float(filtered),
        "rollout/filter_exhausted": float(exhausted),
    }
    if exhausted:
        log.warning(
            "step %d: algo.filter_groups: after %d draws (algo.filter_groups_max_draws=%d) only %d of "
            "data.batch_size=%d prompts had rewards that differ; training on %s. If this persists, the task is too "
            "hard or too easy for the policy (check reward/score_mean), or raise rollout.n / rollout.temperature",
            step,
            draws,
            cap,
            n_kept,
            want,
            f"those {n_kept}" if kept else "the last draw (its rewards carry no comparison)",
        )
    return out
