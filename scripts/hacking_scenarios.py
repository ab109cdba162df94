"""The hacking scenario library's exact optima (docs/hacking.md): for each proxy of tether.tasks.hacks and each β,
π*_β ∝ π_ref·exp(proxy/β) enumerated exactly on the 20 digit-sum prompts, with its gold (exact correctness) and proxy.

    python scripts/hacking_scenarios.py [--betas 0 0.01 0.05 0.2] [--split val|all]

Prints a markdown table: per scenario its half, the flaw's shape, the reference's gold and the mass it puts on
over-paid wrong answers, and π*_β's gold (proxy) per β; "hacks" marks a β whose π*_β gold is below the reference's.
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--betas", nargs="+", type=float, default=[0.0, 0.01, 0.05, 0.2])
    ap.add_argument("--split", default="all", choices=("all", "val"))
    args = ap.parse_args()

    from tether.tasks import digitsum
    from tether.tasks.exact import enumerate_policy, exact_optimum
    from tether.tasks.hacks import SCENARIOS
    from tether.tasks.sft import load_reference

    ref, tok = load_reference()
    rows = digitsum.make_dataset(args.split)
    spaces = []
    for r in rows:
        gt = r["reward_model"]["ground_truth"]
        sp = enumerate_policy(
            ref,
            tok,
            r["prompt"][0]["content"] if isinstance(r["prompt"], list) else r["prompt"],
            digitsum.MAX_NEW_TOKENS,
            1.0,
        )
        gold = np.array([digitsum.compute_score(t, gt) for t in sp.texts])
        spaces.append((gt, sp, gold))
    head = "| scenario | half | shape | ref gold | ref mass on paid wrong answers | " + " | ".join(
        f"π*_{b:g} gold (proxy)" for b in args.betas
    )
    print(head + " |")
    print("|" + "---|" * (5 + len(args.betas)))
    for sc in SCENARIOS:
        per_beta = {b: ([], []) for b in args.betas}
        ref_gold, paid_wrong = [], []
        for gt, sp, gold in spaces:
            proxy = np.array([sc.fn(t, gt) for t in sp.texts])
            p = sp.probs
            ref_gold.append(float(p @ gold))
            paid_wrong.append(float(p[(gold == 0) & (proxy >= 1.0)].sum()))
            for b in args.betas:
                opt = exact_optimum(sp.logprobs, proxy, b)
                q = np.exp(opt.logprobs)
                per_beta[b][0].append(float(q @ gold))
                per_beta[b][1].append(float(q @ proxy))
        rg = statistics.fmean(ref_gold)
        cells = []
        for b in args.betas:
            g, pr = statistics.fmean(per_beta[b][0]), statistics.fmean(per_beta[b][1])
            cells.append(f"{'**' if g < rg else ''}{g:.3f}{'**' if g < rg else ''} ({pr:.3f})")
        print(
            f"| `{sc.name}` | {sc.half} | {sc.shape} | {rg:.3f} | {100 * statistics.fmean(paid_wrong):.1f}% | "
            + " | ".join(cells)
            + " |"
        )
    print("\nbold: π*_β's gold below the reference's (the optimum hacks)")


if __name__ == "__main__":
    main()
