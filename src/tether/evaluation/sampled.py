"""Sampled evaluation: n responses per prompt through the run's rollout engine, scored by a reward (and a gold reward);
``pass@k``, ``maj@k``, ``mean@n``, diversity, lengths, per data source. Validation during training and ``tether eval``
both call :func:`evaluate_prompts`."""

from __future__ import annotations

import logging
import math
import statistics

import torch

from tether.algos import kl_penalty, masked_mean
from tether.batch import RolloutBatch
from tether.metrics.accuracy import accuracy_metrics, default_ks, pass_at_k
from tether.metrics.diversity import diversity_metrics
from tether.rewards import extract_answer
from tether.rollout.agent import agent_metrics, sum_totals

CORRECT_THRESHOLD = 0.5  # a sample counts as correct (pass@k) when its score is at least this


def rows_where(ids: torch.Tensor, keep: torch.Tensor) -> list[list[int]]:
    """Each row's ids where ``keep`` (both (B, L)), in order: one boolean index and one ``tolist`` instead
    of a Python loop over every position (1.1 ms -> 0.1 ms per step for 64 x 32 tokens)."""
    flat = ids[keep].tolist()  # row-major: row 0's kept ids, then row 1's, ...
    out, start = [], 0
    for n in keep.sum(-1).tolist():
        out.append(flat[start : start + n])
        start += n
    return out


def response_tokens(batch: RolloutBatch, eos_id: int) -> list[list[int]]:
    """Each response's valid token ids, EOS removed."""
    return rows_where(batch.response_ids, batch.response_mask.bool() & (batch.response_ids != eos_id))


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
def evaluate_prompts(
    runner,
    reward,
    prompts,
    *,
    n: int | None = None,
    batch_size: int,
    ks: list[int] | None = None,
    indices: list[int] | None = None,
    samples: list[dict] | None = None,
    by_source: dict | None = None,
    kl_probe: KLProbe | None = None,
    progress: bool = False,
    desc: str = "eval",
    k: int | None = None,
    gold=None,
    **gen_overrides,
) -> dict[str, float]:
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
            (False: the reward could not score it: an error, a timeout, a non-finite score; counted 0), ``length``
            (tokens), ``truncated``, ``kl_ref`` (nats per token, with ``kl_probe``), ``prompt``,
            ``response``, ``response_ids`` (the ``length`` sampled token ids); with a multi-turn runner
            (``agent.tools`` / ``agent.environment``) also ``turns`` (model turns), ``tool_calls`` and
            ``tool_errors`` (calls whose observation is an error) of the trajectory, and ``turn_reward``: the sum
            of the environment's per-turn rewards (``StepResult.reward``), which ``score`` includes (the final
            reward plus it: the total the training reward uses, ``reward/score_mean`` + ``reward/turn_reward_mean``).
        by_source: when a dict, filled with ``{data_source: metrics}`` (the accuracy and length
            metrics of :func:`summarize_samples` per source).
        kl_probe: a :class:`KLProbe`: adds ``kl_ref_mean`` / ``kl_ref_k3_mean`` (nats per token, mean
            over responses) and ``kl_ref_seq_mean`` (nats per response).
        progress: show a progress bar (prompts done / total, ETA) on stderr, titled ``desc``.
        gold: a :class:`~tether.rewards.GoldReward` that also scores the same responses (no extra
            generation): each covered sample's record gets ``gold`` (its score; None where unscored, which the
            gold metrics leave out) and ``gold_scored``, and the metrics the ``gold_*`` of :func:`summarize_samples`;
            samples it could not score are counted and warned about, never raised.
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
    agent_totals: list[dict] = []
    bar = _progress(len(idx_all), desc, progress)
    try:
        for start in range(0, len(idx_all), batch_size):
            idx = idx_all[start : start + batch_size]
            batch = runner.rollout(prompts, idx, n, mode="online", **gen_overrides)
            agent_totals.append(batch.extra.get("agent_totals", {}))
            split = "agent_joined" in batch.extra  # agent.on_prefix_mismatch=split: a record per trajectory, whole
            batch = batch.extra.get("agent_joined", batch)
            res = reward(batch.rows, batch.prompts, batch.responses)
            failed = batch.extra.get("agent_failed")  # an environment that raised: unscored (agent/env_errors)
            if failed is not None:
                res.valid = res.valid & ~failed.to(res.valid.device)
            g = gold(batch.rows, batch.prompts, batch.responses) if gold is not None else None  # the same responses
            if g is not None and len(gold_errors) < 3:
                gold_errors += g.errors[: 3 - len(gold_errors)]
            s = torch.where(res.valid, res.raw_scores.nan_to_num(0.0), 0.0).float()
            # a multi-turn trajectory's score is the total the training reward uses: the final score plus the
            # environment's per-turn rewards (StepResult.reward); turn_reward keeps their part apart
            turn = None if batch.turn_rewards is None else batch.turn_rewards.sum(-1).float().to(s.device)
            if turn is not None:
                turn = torch.where(res.valid, turn, 0.0)
                s = s + turn
            ended = torch.isin(
                batch.response_ids, torch.as_tensor(runner.eos_token_ids, device=batch.response_ids.device)
            ).any(-1)
            lengths = batch.response_mask.sum(-1).tolist()
            # under split a trajectory's later pieces were sampled from the template's rendering, not from the joined
            # context: its KL is not measured (the records leave kl_ref out)
            kl = kl_probe(batch) if kl_probe is not None and not split else None
            counts = batch.extra.get("agent_counts")  # a multi-turn runner's turns, tool calls, tool errors
            counts = counts.tolist() if counts is not None else None
            tokens += response_tokens(batch, eos)
            groups += (batch.group_ids.cpu() + start).tolist()
            for j, row in enumerate(batch.rows):
                sc = float(s[j])
                rec = {
                    "index": row.index,
                    "sample": j % n,
                    "data_source": row.data_source,
                    "answer": extract_answer(row.data_source, batch.responses[j], row.extra_info),
                    "score": sc,
                    "correct": sc >= CORRECT_THRESHOLD,
                    "scored": bool(res.valid[j]),
                    "length": int(lengths[j]),
                    "truncated": not bool(ended[j]),
                }
                if g is not None and g.covered[j]:
                    # None where the gold could not score it: a missing measurement, never a 0 (issue 33)
                    rec["gold"], rec["gold_scored"] = (g.scores[j] if g.scored[j] else None), g.scored[j]
                if kl is not None:
                    rec["kl_ref"], rec["kl_ref_k3"] = float(kl[0][j]), float(kl[1][j])
                if counts is not None:
                    rec["turns"], rec["tool_calls"], rec["tool_errors"] = counts[j]
                if turn is not None:
                    rec["turn_reward"] = float(turn[j])
                rec["prompt"], rec["response"] = batch.prompts[j], batch.responses[j]
                rec["response_ids"] = batch.response_ids[j, : int(lengths[j])].tolist()
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
            "%s: %d of %d samples could not be scored by the gold reward (%s; errors or reward.timeout_s): the gold "
            "metrics leave them out (gold_unscored_frac; none at all when no sample was scored); first: %s",
            desc,
            sum(not r["gold_scored"] for r in covered),
            len(covered),
            gold.name(covered[0]["data_source"]) if hasattr(gold, "name") else "gold",
            "; ".join(gold_errors) or "?",
        )
    out |= {key.split("/", 1)[1]: v for key, v in diversity_metrics(tokens, groups).items()}
    out |= agent_metrics(sum_totals(agent_totals))  # a multi-turn runner's agent/* (val/agent/* in validation)
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
        per response); with ``turn_reward`` in the records (a multi-turn run), ``turn_reward_mean`` (the per-turn
        rewards' part of ``score_mean``, which holds final + per-turn); with gold scores in some records,
        :func:`gold_metrics` of those. See
        :mod:`tether.metrics.accuracy`.
    """
    P = len(records) // n
    if P == 0 or P * n != len(records):
        raise ValueError(f"need a positive multiple of n={n} records, got {len(records)}")
    by_prompt = [records[i * n : (i + 1) * n] for i in range(P)]
    S = torch.tensor([[r["score"] for r in g] for g in by_prompt], dtype=torch.float64)  # (P, n)
    out = accuracy_metrics(
        S.tolist(), [[r["correct"] for r in g] for g in by_prompt], [[r["answer"] for r in g] for g in by_prompt], ks
    )
    L = torch.tensor([float(r["length"]) for r in records])
    out |= {
        "score_mean": out[f"mean@{n}"],
        "score_sem": score_sem(S),
        "answered_frac": sum(r["answer"] is not None for r in records) / len(records),
        "unscored_frac": sum(not r.get("scored", True) for r in records) / len(records),
        "length_mean": float(L.mean()),
        "length_max": float(L.max()),
        "truncated_frac": sum(bool(r["truncated"]) for r in records) / len(records),
        "samples": float(len(records)),
    }
    if all("kl_ref" in r for r in records):  # a batch that split (agent.on_prefix_mismatch=split) measured none
        k1 = torch.tensor([r["kl_ref"] for r in records], dtype=torch.float64)
        out["kl_ref_mean"] = float(k1.mean())
        out["kl_ref_k3_mean"] = float(torch.tensor([r["kl_ref_k3"] for r in records], dtype=torch.float64).mean())
        out["kl_ref_seq_mean"] = float((k1 * L.double()).mean())
    if "turns" in records[0]:
        out |= agent_sample_metrics(records)
    if "turn_reward" in records[0]:  # the part of score_mean that the environment's per-turn rewards make
        out["turn_reward_mean"] = math.fsum(r["turn_reward"] for r in records) / len(records)
    covered = [r for r in records if "gold" in r]
    if covered:
        out |= gold_metrics(covered, n, ks, score_mean=out["score_mean"] if len(covered) == len(records) else None)
    return out


def agent_sample_metrics(records: list[dict]) -> dict[str, float]:
    """The agent metrics of per-sample records carrying ``turns``, ``tool_calls`` and ``tool_errors``:
    ``agent/turns_mean`` (model turns per trajectory), ``agent/tool_calls`` and ``agent/tool_errors`` (counts), and
    ``agent/tool_success`` (calls without an error / calls; left out when no tool was called: there is no rate)."""
    calls, errors = sum(r["tool_calls"] for r in records), sum(r["tool_errors"] for r in records)
    out = {
        "agent/turns_mean": sum(r["turns"] for r in records) / len(records),
        "agent/tool_calls": float(calls),
        "agent/tool_errors": float(errors),
    }
    if calls:
        out["agent/tool_success"] = (calls - errors) / calls
    return out


def gold_metrics(records: list[dict], n: int, ks: list[int], *, score_mean: float | None = None) -> dict[str, float]:
    """The gold reward's metrics over the records that carry a gold score (whole prompts, n each, prompt-major).

    Only the samples the gold scored are measured: one it could not score (an error, ``reward.timeout_s``) is left
    out, not counted 0, so a failing gold never looks like a falling one. With none scored, only
    ``gold_unscored_frac`` (1.0) is returned: there is no gold measurement to log.

    Returns:
        ``gold_mean`` (mean gold score over the scored samples), ``gold_gap`` (the training reward's mean over the same
        samples minus ``gold_mean``; ``score_mean`` is passed when every sample has a gold and every one was scored,
        so the difference is exact), ``gold_sem`` (its standard error from sampling: sem² = Σ_p k_p·s²_p / N², k_p the
        scored samples of prompt p, s²_p their unbiased variance, N = Σ k_p; :func:`score_sem` when every k_p = n),
        ``gold_unscored_frac`` (samples the gold could not score) and ``gold_pass@k`` (unbiased pass@k over the
        prompts with at least k scored samples, each from its own scored ones, a sample correct when its gold score
        is at least :data:`CORRECT_THRESHOLD`) for every k in ``ks`` and 1 that some prompt has.
    """
    P = len(records) // n
    if P == 0 or P * n != len(records):
        raise ValueError(f"need a positive multiple of n={n} gold records, got {len(records)}")
    unscored = sum(not r.get("gold_scored", True) for r in records) / len(records)
    groups = [[r for r in records[i * n : (i + 1) * n] if r.get("gold_scored", True)] for i in range(P)]
    G = [[float(r["gold"]) for r in g] for g in groups]  # the scored samples of each prompt
    N = sum(len(g) for g in G)
    if N == 0:
        return {"gold_unscored_frac": unscored}
    gold_mean = math.fsum(math.fsum(g) for g in G) / N
    if score_mean is None or unscored:
        score_mean = math.fsum(float(r["score"]) for g in groups for r in g) / N
    var = math.fsum(len(g) * statistics.variance(g) for g in G if len(g) >= 2)
    out = {
        "gold_mean": gold_mean,
        "gold_gap": score_mean - gold_mean,
        "gold_sem": math.sqrt(var) / N,
        "gold_unscored_frac": unscored,
    }
    for k in sorted({1, *ks}):
        rows = [g for g in G if len(g) >= k]
        if rows:
            out[f"gold_pass@{k}"] = math.fsum(
                pass_at_k(len(g), sum(x >= CORRECT_THRESHOLD for x in g), k) for g in rows
            ) / len(rows)
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
