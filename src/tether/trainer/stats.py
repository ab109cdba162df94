"""Per-step rollout metrics and validation (names as in DESIGN.md; units in docs/metrics.md)."""

from __future__ import annotations

import torch

from tether.algos import kl_penalty
from tether.metrics.diversity import diversity_metrics
from tether.trainer.batch import RolloutBatch

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
    per_tok = lambda x: (torch.where(mask.bool(), x, 0.0).sum(-1) / mask.sum(-1).clamp(min=1))[valid]  # noqa: E731
    kl_seq = torch.where(mask.bool(), batch.kl, 0.0).sum(-1)[valid]
    beta = trainer.beta
    k1 = kl_penalty(batch.old_logprobs, batch.ref_logprobs, "k1", log_ratio_clamp=1e30)
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
    if batch.values is not None:
        m["critic/values_mean"] = _mean(per_tok(batch.values))
        m["critic/returns_mean"] = _mean(per_tok(batch.returns))
    m |= batch.extra.get("reward_metrics", {})
    prompts = [p for p in batch.prompt_ids.tolist()]
    m |= diversity_metrics(_response_tokens(batch, eos), batch.group_ids.tolist(), prompts=[[t for t in p if t != trainer.tok.pad_token_id] for p in prompts])
    return m


@torch.no_grad()
def validate(trainer) -> dict[str, float]:
    """mean@k, pass@k, length and diversity on the held-out prompts, k = trainer.val_n samples each."""
    cfg = trainer.cfg
    k = cfg.trainer.val_n
    scores, lengths, tokens, groups = [], [], [], []
    bs = cfg.data.batch_size
    for start in range(0, len(trainer.val_set), bs):
        idx = list(range(start, min(start + bs, len(trainer.val_set))))
        batch = trainer.roles.engine.rollout(trainer.val_set, idx, k)
        res = trainer.roles.reward(batch.rows, batch.prompts, batch.responses)
        s = torch.where(res.valid, res.raw_scores.nan_to_num(0.0), 0.0).float()
        scores.append(s.view(len(idx), k))
        lengths.append(batch.response_mask.sum(-1).float())
        tokens += _response_tokens(batch, trainer.tok.eos_token_id)
        groups += (batch.group_ids + start).tolist()
    S = torch.cat(scores)  # (prompts, k)
    out = {
        "val/score_mean": float(S.mean()),
        f"val/pass@{k}": float((S >= CORRECT_THRESHOLD).any(-1).float().mean()),
        "val/pass@1": float((S >= CORRECT_THRESHOLD).float().mean()),
        "val/length_mean": float(torch.cat(lengths).mean()),
    }
    out |= {f"val/{key.split('/', 1)[1]}": v for key, v in diversity_metrics(tokens, groups).items()}
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
