"""Per-step rollout metrics and validation (names as in DESIGN.md; units in docs/metrics.md)."""

from __future__ import annotations

import torch

from tether.algos import kl_penalty, masked_mean, zero_variance_groups
from tether.batch import RolloutBatch
from tether.metrics.diversity import diversity_metrics

CORRECT_THRESHOLD = 0.5  # a sample counts as correct (pass@k) when its score is at least this


def _response_tokens(batch: RolloutBatch, eos_id: int) -> list[list[int]]:
    """Each response's valid token ids, EOS removed."""
    out = []
    for ids, m in zip(batch.response_ids.tolist(), batch.response_mask.tolist(), strict=True):
        toks = [t for t, keep in zip(ids, m, strict=True) if keep and t != eos_id]
        out.append(toks)
    return out


def _mean(x: torch.Tensor) -> float:
    return float(x.float().mean()) if x.numel() else float("nan")


def rollout_metrics(trainer, batch: RolloutBatch) -> dict[str, float]:
    """reward/*, kl/*, policy/entropy, response/*, rollout/*, diversity/* for one step's batch."""
    mask = batch.response_mask
    valid = mask.sum(-1) > 0
    lengths = mask.sum(-1).float()
    per_tok = lambda x: masked_mean(x, mask, dim=-1)[valid]  # (B',) each counted response's token mean  # noqa: E731
    kl_seq = torch.where(mask.bool(), batch.kl, 0.0).sum(-1)[valid]
    beta = batch.extra.get("kl_coef", trainer.beta)  # the β that shaped this step's rewards / loss
    k1 = kl_penalty(batch.old_logprobs, batch.ref_logprobs, "k1", log_ratio_clamp=None)
    k3 = kl_penalty(batch.old_logprobs, batch.ref_logprobs, "k3")
    scores = batch.scores[valid]
    eos = trainer.tok.eos_token_id
    truncated = (batch.response_ids == eos).sum(-1) == 0
    m = {
        "reward/score_mean": _mean(scores),
        "reward/score_std": float(scores.std()) if scores.numel() > 1 else 0.0,
        "reward/rlhf_mean": _mean(scores - beta * kl_seq),
        "kl/coef": beta,
        "kl/ref_mean": _mean(per_tok(batch.kl)),
        "kl/ref_seq_mean": _mean(kl_seq),
        "kl/ref_mean_unclamped": _mean(per_tok(k1)),
        "kl/k3_mean": _mean(per_tok(k3)),
        "policy/entropy": _mean(per_tok(batch.entropy)),
        "response/length_mean": _mean(lengths[valid]),
        "response/length_max": float(lengths.max()) if lengths.numel() else 0.0,
        "response/truncated_frac": _mean(truncated[valid].float()),
        "rollout/responses": float(len(batch)),
        "rollout/dropped_count": float((~valid).sum()),
        "ref/logprob_mean": _mean(per_tok(batch.ref_logprobs)),
        "ref/logprob_seq_mean": _mean(torch.where(mask.bool(), batch.ref_logprobs, 0.0).sum(-1)[valid]),
    }
    m |= learning_signal_metrics(batch, grouped=trainer.cfg.algo.adv_estimator in GROUP_ESTIMATORS)
    if batch.values is not None:
        m["critic/values_mean"] = _mean(per_tok(batch.values))
        m["critic/returns_mean"] = _mean(per_tok(batch.returns))
    if batch.rollout_logprobs is not None:
        m |= logprob_diff_metrics(batch.rollout_logprobs, batch.old_logprobs, mask)
    m |= batch.extra.get("reward_metrics", {})
    m |= batch.extra.get("sampling_metrics", {})  # algo.filter_groups (DAPO dynamic sampling)
    keep = valid.tolist()  # diversity of the responses that counted (dropped samples are not the policy's output)
    if any(keep):
        pad = trainer.tok.pad_token_id
        tokens = [t for t, k in zip(_response_tokens(batch, eos), keep, strict=True) if k]
        groups = [g for g, k in zip(batch.group_ids.tolist(), keep, strict=True) if k]
        prompts = [[t for t in p if t != pad] for p, k in zip(batch.prompt_ids.tolist(), keep, strict=True) if k]
        m |= diversity_metrics(tokens, groups, prompts=prompts)
    return m


GROUP_ESTIMATORS = ("grpo", "drgrpo", "rloo", "reinforce_plus_plus_baseline")
"""Advantage estimators whose baseline is the prompt's group (a group of equal scores gives 0)."""


def learning_signal_metrics(batch: RolloutBatch, *, grouped: bool = True) -> dict[str, float]:
    """What the doctor's ``no_learning_signal`` check reads.

    ``rollout/zero_var_group_frac`` (only when ``grouped``: a group-relative estimator, see
    :data:`GROUP_ESTIMATORS`): the fraction of the batch's prompts (groups with a counted response)
    whose counted responses all got the same score, or that have a single one: they give every
    group-relative advantage exactly 0 (all wrong or all right). ``advantages/abs_mean``: the mean
    |advantage| over counted tokens (0 = nothing to learn from this batch).
    """
    valid = batch.response_mask.sum(-1) > 0  # (B,)
    out = {}
    if grouped and batch.scores is not None and bool(valid.any()):
        flat = zero_variance_groups(batch.scores, batch.response_mask, batch.group_ids)[valid]  # (B',)
        groups, first = torch.unique(batch.group_ids[valid], return_inverse=True)
        flat_group = torch.zeros(groups.numel(), dtype=torch.bool, device=flat.device).index_put_((first,), flat)  # (G,)
        out["rollout/zero_var_group_frac"] = float(flat_group.float().mean())
    if batch.advantages is not None and bool(valid.any()):
        out["advantages/abs_mean"] = float(masked_mean(batch.advantages.abs(), batch.response_mask))
    return out


def logprob_diff_metrics(rollout_logprobs: torch.Tensor, old_logprobs: torch.Tensor, response_mask: torch.Tensor) -> dict[str, float]:
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


def distinct_prompt_indices(prompts) -> list[int]:
    """The first row index of each distinct rendered prompt of a PromptSet (offline data holds
    several responses per prompt; evaluation samples each prompt once)."""
    first: dict[str, int] = {}
    for i, t in enumerate(prompts.texts):
        first.setdefault(t, i)
    return list(first.values())


@torch.no_grad()
def evaluate_prompts(runner, reward, prompts, *, k: int, batch_size: int, indices: list[int] | None = None,
                     samples: list[dict] | None = None, **gen_overrides) -> dict[str, float]:
    """Sample ``k`` responses per prompt, score them, and summarise: the evaluation shared by the
    trainer's validation (every ``trainer.val_freq`` steps) and ``tether eval``.

    Args:
        runner: a :class:`~tether.trainer.rollout.RolloutRunner` (always generates here, also for an
            offline run).
        reward: a reward callable ``(rows, prompts, responses) -> RewardResult`` (a RewardManager).
            Its state (running normalisation) is restored afterwards: evaluating never changes training.
        prompts: a PromptSet; indices: which of its rows (default all), each evaluated once.
        k: samples per prompt (1 for greedy decoding).
        batch_size: prompts per generate call (``batch_size * k`` sequences).
        samples: when a list, one dict per response is appended (``index``, ``sample``, ``prompt``,
            ``response``, ``score``, ``correct``, ``length``).
        gen_overrides: passed to the engine (e.g. ``do_sample=False``, ``temperature=0.6``).

    Returns:
        Unprefixed metrics: ``score_mean`` and ``mean@k`` (mean raw score over all samples; a sample the
        reward could not score counts 0), ``score_sem`` (its standard error from sampling, see
        :func:`score_sem`), ``pass@1`` (fraction of samples with score >=
        :data:`CORRECT_THRESHOLD`: the unbiased pass@1 estimate from k samples), ``pass@k`` (fraction of
        prompts with at least one correct sample), ``length_mean`` / ``length_max`` (response tokens,
        EOS included), ``truncated_frac`` (responses that hit the length limit), ``prompts``, and the
        diversity metrics of :func:`tether.metrics.diversity.diversity_metrics` over each prompt's k
        samples (``distinct_1``, ...).

    Raises:
        ValueError: no prompt to evaluate.
    """
    idx_all = list(range(len(prompts))) if indices is None else list(indices)
    if not idx_all:
        raise ValueError("nothing to evaluate: the prompt set is empty")
    saved = reward.state_dict() if hasattr(reward, "state_dict") else None
    eos = runner.tok.eos_token_id
    scores, lengths, truncated, tokens, groups = [], [], [], [], []
    try:
        for start in range(0, len(idx_all), batch_size):
            idx = idx_all[start : start + batch_size]
            batch = runner.rollout(prompts, idx, k, mode="online", **gen_overrides)
            res = reward(batch.rows, batch.prompts, batch.responses)
            s = torch.where(res.valid, res.raw_scores.nan_to_num(0.0), 0.0).float()
            scores.append(s.view(len(idx), k))
            lengths.append(batch.response_mask.sum(-1).float().cpu())
            ended = torch.isin(batch.response_ids, torch.as_tensor(runner.eos_token_ids, device=batch.response_ids.device))
            truncated.append((~ended.any(-1)).float().cpu())
            tokens += _response_tokens(batch, eos)
            groups += (batch.group_ids.cpu() + start).tolist()
            if samples is not None:
                for j in range(len(batch)):
                    sc = float(s[j])
                    samples.append({"index": batch.rows[j].index, "sample": j % k, "prompt": batch.prompts[j], "response": batch.responses[j],
                                    "score": sc, "correct": sc >= CORRECT_THRESHOLD, "length": int(batch.response_mask[j].sum())})
    finally:
        if saved is not None:
            reward.load_state_dict(saved)
    S = torch.cat(scores)  # (prompts, k)
    L = torch.cat(lengths)
    out = {
        "score_mean": float(S.mean()),
        "score_sem": score_sem(S),
        f"mean@{k}": float(S.mean()),
        "pass@1": float((S >= CORRECT_THRESHOLD).float().mean()),
        f"pass@{k}": float((S >= CORRECT_THRESHOLD).any(-1).float().mean()),
        "length_mean": float(L.mean()),
        "length_max": float(L.max()),
        "truncated_frac": float(torch.cat(truncated).mean()),
        "prompts": float(len(idx_all)),
    }
    out |= {key.split("/", 1)[1]: v for key, v in diversity_metrics(tokens, groups).items()}
    return out


def score_sem(S: torch.Tensor) -> float:
    """Standard error of ``S.mean()`` from sampling, for (P prompts, k samples) scores.

    The within-prompt variance only: two validations on the same prompts differ by sampling noise,
    not by which prompts were drawn. sem² = Σ_p s²_p / k / P², s²_p the unbiased variance of prompt
    p's k samples (0 when k = 1, where the noise cannot be estimated).
    """
    P, k = S.shape
    if k < 2:
        return 0.0
    return float(S.double().var(dim=1, unbiased=True).sum().sqrt() / (P * k**0.5))


def validate(trainer) -> dict[str, float]:
    """``val/*``: :func:`evaluate_prompts` on the held-out prompts, k = ``trainer.val_n`` samples each,
    with the training sampling settings; plus ``exact/*`` on the embedded task. In an offline run
    the policy generates (each distinct prompt once) and generated responses are scored by the
    reward function (``roles.val_reward``), not by the dataset's score column."""
    cfg = trainer.cfg
    reward = getattr(trainer.roles, "val_reward", None) or trainer.roles.reward
    indices = distinct_prompt_indices(trainer.val_set) if cfg.rollout.mode == "offline" else None
    m = evaluate_prompts(trainer.roles.engine, reward, trainer.val_set, k=cfg.trainer.val_n, batch_size=cfg.data.batch_size, indices=indices)
    out = {f"val/{key}": v for key, v in m.items()}
    if exact_evaluation_applies(cfg):
        out |= exact_metrics(trainer)
    return out


def exact_evaluation_applies(cfg) -> bool:
    """Exact enumeration needs the embedded task and plain temperature sampling (no top-p/top-k)."""
    return cfg.data.train_files == "embedded" and cfg.rollout.top_p == 1.0 and cfg.rollout.top_k == 0 and cfg.rollout.do_sample


def exact_metrics(trainer) -> dict[str, float]:
    """``exact/*``: the policy against π_ref and the exact optimum π* ∝ π_ref·exp(r/β) on the distinct val
    prompts, by enumerating every response (see tether.tasks.exact). β is the current β."""
    from tether.tasks.exact import evaluate_policy

    if not hasattr(trainer, "_exact_ref_cache"):
        trainer._exact_ref_cache = {}
    actor = trainer.roles.actor.model
    was_training = actor.training
    actor.eval()
    with trainer.roles.ref._context():
        out = evaluate_policy(
            actor, trainer.roles.ref.module, trainer.tok, list(dict.fromkeys(r.prompt for r in trainer.val_set.rows)), max(trainer.beta, 1e-6),
            temperature=trainer.cfg.rollout.temperature, n_samples=trainer.cfg.rollout.n, ref_cache=trainer._exact_ref_cache,
        )  # fmt: skip
    actor.train(was_training)
    return out
