"""Per-step rollout metrics and validation (names as in DESIGN.md; units in docs/metrics.md)."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch

from tether.algos import kl_penalty, masked_mean, zero_variance_groups
from tether.batch import RolloutBatch
from tether.metrics.diversity import diversity_metrics

CORRECT_THRESHOLD = 0.5  # a sample counts as correct (pass@k) when its score is at least this


def _rows_where(ids: torch.Tensor, keep: torch.Tensor) -> list[list[int]]:
    """Each row's ids where ``keep`` (both (B, L)), in order: one boolean index and one ``tolist`` instead
    of a Python loop over every position (1.1 ms -> 0.1 ms per step for 64 x 32 tokens)."""
    flat = ids[keep].tolist()  # row-major: row 0's kept ids, then row 1's, ...
    out, start = [], 0
    for n in keep.sum(-1).tolist():
        out.append(flat[start : start + n])
        start += n
    return out


def _response_tokens(batch: RolloutBatch, eos_id: int) -> list[list[int]]:
    """Each response's valid token ids, EOS removed."""
    return _rows_where(batch.response_ids, batch.response_mask.bool() & (batch.response_ids != eos_id))


def _mean(x: torch.Tensor) -> float:
    return float(x.float().mean()) if x.numel() else float("nan")


def rollout_metrics(batch: RolloutBatch, *, beta: float, eos_id: int, pad_id: int, grouped: bool) -> dict[str, float]:
    """reward/*, kl/*, policy/entropy, response/*, rollout/*, diversity/* for one step's batch.

    Args:
        batch: the step's batch (scores, kl, old_logprobs, ref_logprobs, entropy set).
        beta: the current β, used only when ``batch.extra["kl_coef"]`` (the β that shaped this step's
            rewards / loss) is absent.
        eos_id, pad_id: the tokenizer's EOS and padding ids (truncation, diversity).
        grouped: the advantage estimator's baseline is the prompt's group (:data:`GROUP_ESTIMATORS`).
    """
    mask = batch.response_mask
    valid = mask.sum(-1) > 0
    lengths = mask.sum(-1).float()
    per_tok = lambda x: masked_mean(x, mask, dim=-1)[valid]  # (B',) each counted response's token mean  # noqa: E731
    kl_seq = torch.where(mask.bool(), batch.kl, 0.0).sum(-1)[valid]
    beta = batch.extra.get("kl_coef", beta)  # the β that shaped this step's rewards / loss
    k1 = kl_penalty(batch.old_logprobs, batch.ref_logprobs, "k1", log_ratio_clamp=None)
    k3 = kl_penalty(batch.old_logprobs, batch.ref_logprobs, "k3")
    scores = batch.scores[valid]
    eos = eos_id
    # no EOS: cut at rollout.max_new_tokens (every EOS id of the model, batch.truncated; the tokenizer's alone for a hand-built batch)
    truncated = batch.truncated.to(mask.device) if batch.truncated is not None else (batch.response_ids == eos).sum(-1) == 0
    m = {
        "reward/score_mean": _mean(scores),
        "reward/score_std": float(scores.std()) if scores.numel() > 1 else 0.0,
        "reward/rlhf_mean": _mean(scores - beta * kl_seq),
        "kl/coef": beta,
        "kl/ref_mean": _mean(per_tok(batch.kl)),
        "kl/ref_seq_mean": _mean(kl_seq),
        "kl/ref_mean_unclamped": _mean(per_tok(k1)),
        "kl/k3_mean": _mean(per_tok(k3)),
        "policy/entropy": _mean(per_tok(batch.entropy)) if batch.entropy is not None else float("nan"),  # None: old_logprobs_source=rollout
        "response/length_mean": _mean(lengths[valid]),
        "response/length_max": float(lengths.max()) if lengths.numel() else 0.0,
        "response/truncated_frac": _mean(truncated[valid].float()),
        "rollout/responses": float(len(batch)),
        "rollout/dropped_count": float((~valid).sum()),
        "ref/logprob_mean": _mean(per_tok(batch.ref_logprobs)),
        "ref/logprob_seq_mean": _mean(torch.where(mask.bool(), batch.ref_logprobs, 0.0).sum(-1)[valid]),
    }
    m |= learning_signal_metrics(batch, grouped=grouped)
    if batch.values is not None:
        m["critic/values_mean"] = _mean(per_tok(batch.values))
        m["critic/returns_mean"] = _mean(per_tok(batch.returns))
    from_rollout = batch.extra.get("old_logprobs_metrics", {}).get("rollout/old_logprobs_from_rollout") == 1.0
    if batch.rollout_logprobs is not None and not from_rollout:  # old_logprobs := rollout_logprobs would read 0: nothing measured
        m |= logprob_diff_metrics(batch.rollout_logprobs, batch.old_logprobs, mask)
    m |= batch.extra.get("reward_metrics", {})
    m |= batch.extra.get("sampling_metrics", {})  # algo.filter_groups (DAPO dynamic sampling)
    m |= batch.extra.get("old_logprobs_metrics", {})  # actor.old_logprobs_source=rollout
    m |= batch.extra.get("rollout_corr_metrics", {})  # algo.rollout_correction (Trainer.correct_rollout)
    m |= batch.extra.get("async_metrics", {})  # rollout.async_steps: rollout/staleness, rollout/stale_dropped
    m |= batch.extra.get("control_metrics", {})  # actor/entropy_coef; algo.mask_truncated, algo.top_entropy_quantile (Trainer.mask_tokens)
    keep = valid.tolist()  # diversity of the responses that counted (dropped samples are not the policy's output)
    if any(keep):
        pad = pad_id
        tokens = [t for t, k in zip(_response_tokens(batch, eos), keep, strict=True) if k]
        groups = [g for g, k in zip(batch.group_ids.tolist(), keep, strict=True) if k]
        prompts = [p for p, k in zip(_rows_where(batch.prompt_ids, batch.prompt_ids != pad), keep, strict=True) if k]
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


def capped_indices(indices: list[int], max_prompts: int | None, seed: int) -> list[int]:
    """At most ``max_prompts`` of ``indices``: a subset drawn with ``random.Random(seed)``, kept in
    their original order, the same for the same arguments (``trainer.val_max_prompts``)."""
    if max_prompts is None or len(indices) <= max_prompts:
        return list(indices)
    import random

    keep = set(random.Random(seed).sample(range(len(indices)), max_prompts))
    return [i for j, i in enumerate(indices) if j in keep]


class KLProbe:
    """Per-token KL to the reference of sampled responses, for evaluation.

    ``policy`` and ``reference`` are objects with ``compute_logprobs(batch) -> (B, T)`` log-probs in
    nats at the sampling temperature (:class:`~tether.workers.actor.ReferenceWorker` wraps any model,
    LoRA adapters included); :meth:`__call__` returns each response's k1 = mean over its valid tokens
    of log π − log π_ref (an unbiased estimate of KL(π‖π_ref) per token on π's own samples, as the
    trainer's ``kl/ref_mean_unclamped``) and k3 = mean of e^(−r) + r − 1, both (B,).
    """

    def __init__(self, policy, reference):
        self.policy, self.reference = policy, reference

    def __call__(self, batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor]:
        lp = self.policy.compute_logprobs(batch).float()
        ref = self.reference.compute_logprobs(batch).float()
        mask = batch.response_mask
        k1 = kl_penalty(lp, ref, "k1", log_ratio_clamp=None)
        k3 = kl_penalty(lp, ref, "k3")
        return masked_mean(k1, mask, dim=-1).cpu(), masked_mean(k3, mask, dim=-1).cpu()


def _progress(total: int, desc: str, enabled: bool):
    if not enabled:
        return None
    import sys

    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="prompt", dynamic_ncols=True, leave=False, file=sys.stderr, mininterval=0)


@torch.no_grad()
def evaluate_prompts(runner, reward, prompts, *, n: int | None = None, batch_size: int, ks: list[int] | None = None,
                     indices: list[int] | None = None, samples: list[dict] | None = None, by_source: dict | None = None,
                     kl_probe: KLProbe | None = None, progress: bool = False, desc: str = "eval", k: int | None = None,
                     gold=None, **gen_overrides) -> dict[str, float]:  # fmt: skip
    """Sample ``n`` responses per prompt, score them, and summarise: the evaluation shared by the
    trainer's validation (every ``trainer.val_freq`` steps) and ``tether eval``.

    Args:
        runner: a :class:`~tether.rollout.runner.RolloutRunner` (always generates here, also for an
            offline run) around the run's rollout engine (HF or vLLM).
        reward: a reward callable ``(rows, prompts, responses) -> RewardResult`` (a RewardManager).
            Its state (running normalisation) is restored afterwards: evaluating never changes training.
        prompts: a PromptSet; indices: which of its rows (default all), each evaluated once.
        n: samples per prompt (1 for greedy decoding); ``k`` is its former name.
        ks: the k of pass@k and maj@k (each <= n; default 1, 2, 4, ... and n).
        batch_size: prompts per generate call (``batch_size * n`` sequences).
        samples: when a list, one record per response is appended: ``index`` (the row's source index),
            ``sample`` (0..n-1), ``data_source``, ``answer`` (the extracted answer,
            :func:`tether.rewards.extract_answer`, or None), ``score``, ``correct``, ``scored``
            (False: the reward could not score it: an error, a timeout, a non-finite score), ``length``
            (tokens), ``truncated``, ``kl_ref`` (nats per token, with ``kl_probe``), ``prompt``,
            ``response``.
        by_source: when a dict, filled with ``{data_source: metrics}`` (the accuracy and length
            metrics of :func:`summarize_samples` per source).
        kl_probe: a :class:`KLProbe`: adds ``kl_ref_mean`` / ``kl_ref_k3_mean`` (nats per token, mean
            over responses) and ``kl_ref_seq_mean`` (nats per response).
        progress: show a progress bar (prompts done / total, ETA) on stderr, titled ``desc``.
        gold: a :class:`~tether.rewards.GoldReward` that also scores the same responses (no extra
            generation): each covered sample's record gets ``gold`` (its score, 0 where unscored) and
            ``gold_scored``, and the metrics the ``gold_*`` of :func:`summarize_samples`; samples it could
            not score are counted and warned about, never raised.
        gen_overrides: passed to the engine (e.g. ``do_sample=False``, ``temperature=0.6``).

    Returns:
        Unprefixed metrics: those of :func:`summarize_samples` over all prompts (``pass@k``,
        ``maj@k``, ``mean@n``, ``score_mean``, ``score_sem``, lengths, ``truncated_frac``, ...) plus
        the diversity metrics of :func:`tether.metrics.diversity.diversity_metrics` over each
        prompt's n samples (``distinct_1``, ...); with a ``gold`` that covers some samples, ``gold_mean``,
        ``gold_gap``, ``gold_sem``, ``gold_unscored_frac`` and ``gold_pass@k``.

    Raises:
        ValueError: no prompt to evaluate, or a k > n.
    """
    from tether.metrics.accuracy import default_ks
    from tether.rewards import extract_answer

    n = n if n is not None else k
    if n is None or n < 1:
        raise ValueError(f"evaluate_prompts needs n >= 1 samples per prompt, got {n}")
    ks = default_ks(n) if ks is None else sorted(set(ks))
    if any(not 1 <= x <= n for x in ks):
        raise ValueError(f"every k must be in 1..n={n}, got {ks}")
    idx_all = list(range(len(prompts))) if indices is None else list(indices)
    if not idx_all:
        raise ValueError("nothing to evaluate: the prompt set is empty")
    saved = reward.state_dict() if hasattr(reward, "state_dict") else None
    eos = runner.tok.eos_token_id
    records: list[dict] = []
    tokens, groups = [], []
    gold_errors: list[str] = []
    bar = _progress(len(idx_all), desc, progress)
    try:
        for start in range(0, len(idx_all), batch_size):
            idx = idx_all[start : start + batch_size]
            batch = runner.rollout(prompts, idx, n, mode="online", **gen_overrides)
            res = reward(batch.rows, batch.prompts, batch.responses)
            g = gold(batch.rows, batch.prompts, batch.responses) if gold is not None else None  # the same responses
            if g is not None and len(gold_errors) < 3:
                gold_errors += g.errors[: 3 - len(gold_errors)]
            s = torch.where(res.valid, res.raw_scores.nan_to_num(0.0), 0.0).float()
            ended = torch.isin(batch.response_ids, torch.as_tensor(runner.eos_token_ids, device=batch.response_ids.device)).any(-1)
            lengths = batch.response_mask.sum(-1).tolist()
            kl = kl_probe(batch) if kl_probe is not None else None
            tokens += _response_tokens(batch, eos)
            groups += (batch.group_ids.cpu() + start).tolist()
            for j, row in enumerate(batch.rows):
                sc = float(s[j])
                rec = {"index": row.index, "sample": j % n, "data_source": row.data_source,
                       "answer": extract_answer(row.data_source, batch.responses[j], row.extra_info),
                       "score": sc, "correct": sc >= CORRECT_THRESHOLD, "scored": bool(res.valid[j]), "length": int(lengths[j]),
                       "truncated": not bool(ended[j])}  # fmt: skip
                if g is not None and g.covered[j]:
                    rec["gold"], rec["gold_scored"] = g.scores[j], g.scored[j]
                if kl is not None:
                    rec["kl_ref"], rec["kl_ref_k3"] = float(kl[0][j]), float(kl[1][j])
                rec["prompt"], rec["response"] = batch.prompts[j], batch.responses[j]
                records.append(rec)
            if bar is not None:
                bar.update(len(idx))
    finally:
        if saved is not None:
            reward.load_state_dict(saved)
        if bar is not None:
            bar.close()
    out = summarize_samples(records, n, ks)
    if out.get("gold_unscored_frac"):
        covered = [r for r in records if "gold" in r]
        logging.getLogger("tether").warning(
            "%s: %d of %d samples could not be scored by the gold reward (%s; errors or reward.timeout_s): gold_mean counts them 0 "
            "(gold_unscored_frac); first: %s", desc, sum(not r["gold_scored"] for r in covered), len(covered),
            gold.name(covered[0]["data_source"]) if hasattr(gold, "name") else "gold", "; ".join(gold_errors) or "?",
        )  # fmt: skip
    out |= {key.split("/", 1)[1]: v for key, v in diversity_metrics(tokens, groups).items()}
    if by_source is not None:
        sources = list(dict.fromkeys(r["data_source"] for r in records))
        for ds in sources:
            by_source[ds] = summarize_samples([r for r in records if r["data_source"] == ds], n, ks)
    if samples is not None:
        samples.extend(records)
    return out


def summarize_samples(records: list[dict], n: int, ks: list[int]) -> dict[str, float]:
    """Metrics of per-sample records (as :func:`evaluate_prompts` writes them, prompt-major, n per prompt).

    Returns:
        ``pass@k`` (unbiased, Chen et al. 2021) and ``maj@k`` for every k in ``ks`` (``pass@1`` always),
        ``mean@{n}`` and ``score_mean`` (mean raw score; a sample the reward could not score counts 0),
        ``score_sem`` (its standard error from sampling, :func:`score_sem`), ``answered_frac`` (samples
        with an extracted answer), ``unscored_frac`` (samples the reward could not score, counted 0;
        records without ``scored`` count as scored), ``length_mean`` / ``length_max`` (response tokens, EOS included),
        ``truncated_frac`` (responses that hit the length limit), ``prompts``, ``samples``; with KL in
        the records, ``kl_ref_mean``, ``kl_ref_k3_mean`` (nats per token) and ``kl_ref_seq_mean`` (nats
        per response); with gold scores in some records, :func:`gold_metrics` of those. See
        :mod:`tether.metrics.accuracy`.
    """
    from tether.metrics.accuracy import accuracy_metrics

    P = len(records) // n
    if P == 0 or P * n != len(records):
        raise ValueError(f"need a positive multiple of n={n} records, got {len(records)}")
    by_prompt = [records[i * n : (i + 1) * n] for i in range(P)]
    S = torch.tensor([[r["score"] for r in g] for g in by_prompt], dtype=torch.float64)  # (P, n)
    out = accuracy_metrics(S.tolist(), [[r["correct"] for r in g] for g in by_prompt], [[r["answer"] for r in g] for g in by_prompt], ks)
    L = torch.tensor([float(r["length"]) for r in records])
    out |= {
        "score_mean": out[f"mean@{n}"], "score_sem": score_sem(S),
        "answered_frac": sum(r["answer"] is not None for r in records) / len(records),
        "unscored_frac": sum(not r.get("scored", True) for r in records) / len(records),
        "length_mean": float(L.mean()), "length_max": float(L.max()),
        "truncated_frac": sum(bool(r["truncated"]) for r in records) / len(records), "samples": float(len(records)),
    }  # fmt: skip
    if "kl_ref" in records[0]:
        k1 = torch.tensor([r["kl_ref"] for r in records], dtype=torch.float64)
        out["kl_ref_mean"] = float(k1.mean())
        out["kl_ref_k3_mean"] = float(torch.tensor([r["kl_ref_k3"] for r in records], dtype=torch.float64).mean())
        out["kl_ref_seq_mean"] = float((k1 * L.double()).mean())
    covered = [r for r in records if "gold" in r]
    if covered:
        out |= gold_metrics(covered, n, ks, score_mean=out["score_mean"] if len(covered) == len(records) else None)
    return out


def gold_metrics(records: list[dict], n: int, ks: list[int], *, score_mean: float | None = None) -> dict[str, float]:
    """The gold reward's metrics over the records that carry a gold score (whole prompts, n each, prompt-major).

    Returns:
        ``gold_mean`` (mean gold score; a sample the gold could not score counts 0, as in ``score_mean``),
        ``gold_gap`` (the training reward's mean over the same samples minus ``gold_mean``: ``score_mean −
        gold_mean`` when every sample has a gold; ``score_mean`` is passed then, so the difference is exact),
        ``gold_sem`` (:func:`score_sem` of the gold scores), ``gold_unscored_frac`` (samples the gold could
        not score) and ``gold_pass@k`` (unbiased pass@k, a sample correct when its gold score is at least
        :data:`CORRECT_THRESHOLD`) for every k in ``ks`` and 1.
    """
    from tether.metrics.accuracy import pass_at_k

    P = len(records) // n
    if P == 0 or P * n != len(records):
        raise ValueError(f"need a positive multiple of n={n} gold records, got {len(records)}")
    G = [[float(r["gold"]) for r in records[i * n : (i + 1) * n]] for i in range(P)]  # (P, n)
    mean = lambda rows: math.fsum(math.fsum(g) / n for g in rows) / P  # noqa: E731 - as accuracy_metrics' mean@n
    gold_mean = mean(G)
    if score_mean is None:
        score_mean = mean([[float(r["score"]) for r in records[i * n : (i + 1) * n]] for i in range(P)])
    out = {"gold_mean": gold_mean, "gold_gap": score_mean - gold_mean, "gold_sem": score_sem(torch.tensor(G, dtype=torch.float64)),
           "gold_unscored_frac": sum(not r.get("gold_scored", True) for r in records) / len(records)}  # fmt: skip
    for k in sorted({1, *ks}):
        out[f"gold_pass@{k}"] = math.fsum(pass_at_k(n, sum(x >= CORRECT_THRESHOLD for x in g), k) for g in G) / P
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


def validate(cfg, roles, val_set, *, beta: float, exact_cache: ExactCache | None = None) -> dict[str, float]:
    """``val/*``: :func:`evaluate_prompts` on the held-out prompts, n = ``trainer.val_n`` samples each,
    with the training sampling settings, on at most ``trainer.val_max_prompts`` of them (a subset
    fixed by ``trainer.seed``); ``val/<data_source>/*`` per source when there are several; plus
    ``exact/*`` on the embedded task. With a gold reward (``roles.gold``, a
    :class:`~tether.rewards.GoldReward` covering some of the val rows), the same responses are scored by
    it too: ``val/gold_mean``, ``val/gold_gap``, ``val/gold_sem``, ``val/gold_unscored_frac``,
    ``val/gold_pass@k`` (and per source). In an offline run the policy generates (each distinct prompt
    once) and generated responses are scored by the reward function (``roles.val_reward``), not by
    the dataset's score column.

    Args:
        cfg: the run's config; roles: its ``Roles`` (engine, reward, val_reward, gold; for exact/* the
            actor's model, the reference and the tokenizer); val_set: the prepared held-out prompts.
        beta: the current β (exact/*'s optimum π* ∝ π_ref·exp(r/β)).
        exact_cache: what exact/* keeps between validations (a fresh one when None).
    """
    reward = getattr(roles, "val_reward", None) or roles.reward
    indices = distinct_prompt_indices(val_set) if cfg.rollout.mode == "offline" else list(range(len(val_set)))
    indices = capped_indices(indices, cfg.trainer.val_max_prompts, cfg.trainer.seed)
    per_source: dict[str, dict] = {}
    m = evaluate_prompts(roles.engine, reward, val_set, n=cfg.trainer.val_n, batch_size=cfg.data.batch_size, indices=indices,
                         by_source=per_source, progress=cfg.trainer.progress, desc="validation", gold=getattr(roles, "gold", None))  # fmt: skip
    out = {f"val/{key}": v for key, v in m.items()}
    if m.get("unscored_frac"):
        logging.getLogger("tether").warning("validation: %.0f of %.0f samples could not be scored by the reward (errors or reward.timeout_s): val/score_mean "
                    "and val/pass@k count them 0 (val/unscored_frac)", m["unscored_frac"] * m["samples"], m["samples"])  # fmt: skip
    if len(per_source) > 1:
        out |= {f"val/{ds}/{key}": v for ds, sm in per_source.items() for key, v in sm.items()}
    if cfg.exact_evaluation_applies:
        prompts = list(dict.fromkeys(r.prompt for r in val_set.rows))
        out |= exact_metrics(roles.actor.model, roles.ref, roles.tokenizer, prompts, beta=beta, temperature=cfg.rollout.temperature,
                             n_samples=cfg.rollout.n, cache=exact_cache if exact_cache is not None else ExactCache(),
                             task=cfg.data.embedded_task)  # fmt: skip
    return out


@dataclass
class ExactCache:
    """What exact/* keeps between validations: the reference's enumerated responses (``ref``, emptied by
    :meth:`reset_ref` when the reference's weights change: ``ref.reset_every``, a checkpoint that loads
    them) and whether the response space is too large to enumerate (``skipped``, decided and warned
    about once; ``checked`` once decided)."""

    ref: dict = field(default_factory=dict)
    skipped: str | None = None
    checked: bool = False

    def reset_ref(self) -> None:
        self.ref.clear()


def exact_metrics(policy, ref, tok, prompts: list[str], *, beta: float, temperature: float, n_samples: int, cache: ExactCache,
                  task: str = "digitsum") -> dict[str, float]:  # fmt: skip
    """``exact/*``: the policy against π_ref and the exact optimum π* ∝ π_ref·exp(r/β) on ``prompts`` (the
    distinct val prompts), by enumerating every response (see tether.tasks.exact). β is the current β.

    Args:
        policy: the actor's model; ref: the ReferenceWorker (its ``module`` and ``as_reference()``: a LoRA
            reference is the policy with its adapters disabled); tok: the tokenizer.
        n_samples: rollout.n (pass@k and the like); cache: see :class:`ExactCache`.
        task: data.embedded_task: its training reward is exact/*'s reward; a task whose reward is a proxy
            (digitsum_hack) adds exact/gold_mean, exact/ref_gold_mean and exact/opt_gold_mean.
    Returns:
        {} when the response space is too large (one warning, the first time).
    """
    from tether.tasks import embedded_task
    from tether.tasks.exact import evaluate_policy, exact_space_problem

    if not cache.checked:
        cache.checked, cache.skipped = True, exact_space_problem(policy, prompts)
        if cache.skipped:
            logging.getLogger("tether").warning("%s", cache.skipped)
    if cache.skipped:
        return {}
    was_training = policy.training
    policy.eval()
    with ref.as_reference():
        mod = embedded_task(task)
        out = evaluate_policy(
            policy, ref.module, tok, prompts, max(beta, 1e-6), temperature=temperature, n_samples=n_samples, ref_cache=cache.ref,
            reward_fn=mod.compute_score, gold_fn=getattr(mod, "gold_score", None),
        )  # fmt: skip
    policy.train(was_training)
    return out
