"""Bias and spread of the k1, k2, k3 KL estimators against the exact KL, for trained policies.

For each run directory given, the policy of its latest complete checkpoint and the shipped reference are
enumerated on the 20 prompts of the embedded task; :func:`tether.tasks.exact.expected_kl_estimators`
gives each estimator's exact expectation and the standard deviation of one response's value, under both
aggregations the trainer uses (``_tok``: mean over a response's tokens, the unit of ``kl/ref_mean``;
``_seq``: sum over the response). A sampled check draws batches of 128 responses from the enumerated
distribution (which is the sampler's distribution) and reports the empirical mean and spread of the batch
estimate.

Usage:  python scripts/kl_estimators.py RUN_DIR [RUN_DIR ...] [--out docs/figures/kl_estimators.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch


def _policy(run_dir: Path):
    from transformers import AutoModelForCausalLM

    from tether.checkpoint import latest_valid_checkpoint

    ckpt = latest_valid_checkpoint(run_dir / "checkpoints")
    if ckpt is None:
        raise SystemExit(f"{run_dir}: no complete checkpoint")
    model = AutoModelForCausalLM.from_pretrained(ckpt / "actor")
    model.eval()
    return model, ckpt.name


def estimator_stats(policy, ref, tok, prompts, ref_cache, *, batch=128, reps=2000, seed=0) -> dict:
    """Exact and sampled statistics of k1/k2/k3, averaged over ``prompts`` (see the module docstring)."""
    from tether.tasks import digitsum
    from tether.tasks.exact import _prompt_spec, enumerate_policy, expected_kl_estimators

    rng = np.random.default_rng(seed)
    exact: dict[str, list[float]] = {}
    sampled: dict[str, list[float]] = {}
    for text in prompts:
        text, gt, extra, T = _prompt_spec(text, None, digitsum.compute_score)
        key = (text, T, 1.0)
        if key not in ref_cache:
            ref_cache[key] = enumerate_policy(ref, tok, text, T, 1.0)
        rs = ref_cache[key]
        ps = enumerate_policy(policy, tok, text, T, 1.0)
        for k, v in expected_kl_estimators(ps, rs).items():
            exact.setdefault(k, []).append(v)
        # sampled: batches of `batch` responses from the enumerated π
        p = ps.probs / ps.probs.sum()
        mask = ps.ids >= 0
        lr = np.where(mask, ps.token_logprobs - rs.token_logprobs, 0.0)
        n = ps.lengths.astype(np.float64)
        per = {"k1": lr, "k2": 0.5 * lr**2, "k3": np.where(mask, np.expm1(-lr) + lr, 0.0)}
        idx = rng.choice(len(p), size=(reps, batch), p=p)
        for name, v in per.items():
            tokmean = v.sum(1) / n
            est = tokmean[idx].mean(1)  # (reps,) batch estimates of the per-token KL
            sampled.setdefault(f"{name}_tok_batch_mean", []).append(float(est.mean()))
            sampled.setdefault(f"{name}_tok_batch_std", []).append(float(est.std()))
    out = {k: float(np.mean(v)) for k, v in exact.items()}
    out |= {k: float(np.mean(v)) for k, v in sampled.items()}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, default=Path("docs/figures/kl_estimators.json"))
    ap.add_argument("--prompts", default="all", choices=["all", "train", "val"])
    args = ap.parse_args()
    torch.set_num_threads(1)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    from tether.sweep import exact_prompts
    from tether.tasks.sft import load_reference

    ref, tok = load_reference()
    prompts = exact_prompts(args.prompts)
    cache: dict = {}
    results = {}
    for run in args.runs:
        policy, ckpt = _policy(run)
        stats = estimator_stats(policy, ref, tok, prompts, cache)
        results[run.name] = {"checkpoint": ckpt} | stats
        s = stats
        print(f"{run.name} ({ckpt}): exact KL/tok {s['kl_tok']:.4f}  seq {s['kl_seq']:.4f}")
        for k in ("k1", "k2", "k3"):
            print(
                f"  {k}: tok mean {s[f'{k}_tok']:.4f} (bias {s[f'{k}_tok'] - s['kl_tok']:+.4f}) std/response "
                f"{s[f'{k}_tok_std']:.4f} | seq mean {s[f'{k}_seq']:.4f} (bias {s[f'{k}_seq'] - s['kl_seq']:+.4f}) std "
                f"{s[f'{k}_seq_std']:.4f} | sampled batch-128 mean {s[f'{k}_tok_batch_mean']:.4f} ± "
                f"{s[f'{k}_tok_batch_std']:.4f}"
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"prompts": args.prompts, "results": results}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
