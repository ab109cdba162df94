"""Exact numbers of the digitsum_tool reference and its optimum pi*_beta per beta (docs/task.md).

python scripts/digitsum_tool_numbers.py [MODEL_DIR] [all|train|val]
"""

import sys
import time

import numpy as np
from transformers import AutoModelForCausalLM, AutoTokenizer

from tether.tasks import digitsum_tool as dt
from tether.tasks.exact import enumerate_trajectories, evaluate_trajectories, exact_optimum, expected_reward

path = sys.argv[1] if len(sys.argv) > 1 else str(dt.reference_path())
m = AutoModelForCausalLM.from_pretrained(path)
m.eval()
tok = AutoTokenizer.from_pretrained(path)
rows = dt.make_dataset(sys.argv[2] if len(sys.argv) > 2 else "all")
t0 = time.perf_counter()
per = []
spaces = []
for r in rows:
    k, s = r["extra_info"]["k"], r["extra_info"]["s"]
    ts = enumerate_trajectories(
        m, tok, r["prompt"], lambda t, x, k=k, s=s: dt.transition(k, s, t, x), k + 1, max_turns=2
    )
    spaces.append(ts)
    per.append(evaluate_trajectories(ts, ts, 0.1))
print(
    f"{len(rows)} prompts, {len(spaces[0])} trajectories each, {time.perf_counter() - t0:.1f}s; "
    f"mass {np.mean([t.space.total_mass for t in spaces]):.6f}"
)
keys = ("ref_score_mean", "ref_tool_call_rate", "score_after_call", "score_direct")
print("ref: " + "  ".join(f"{k} {np.mean([d[k] for d in per]):.4f}" for k in keys))
print("beta | opt objective | opt E[r] | opt KL_seq | opt tool-call | opt correct_eff_answers | ref objective gap")
for beta in (0.0, 0.01, 0.05, 0.1, 0.2, 0.5, 1.0):
    ds = [evaluate_trajectories(ts, ts, max(beta, 1e-9)) for ts in spaces] if beta > 0 else None
    if beta == 0:
        vals = []
        for ts in spaces:
            o = exact_optimum(ts.space.logprobs, ts.rewards, 0.0)
            vals.append(
                (
                    o.value,
                    o.expected_reward,
                    o.kl,
                    float(np.exp(o.logprobs[ts.turns > 1]).sum()),
                    float("nan"),
                    o.value - expected_reward(ts.space.logprobs, ts.rewards),
                )
            )
        v = np.mean(vals, axis=0)
    else:
        v = [
            np.mean([d[k] for d in ds])
            for k in (
                "opt_objective",
                "opt_score_mean",
                "opt_kl_ref_seq",
                "opt_tool_call_rate",
                "opt_correct_effective_answers",
                "objective_gap",
            )
        ]
    print(f"{beta} | " + " | ".join(f"{x:.4f}" for x in v))
