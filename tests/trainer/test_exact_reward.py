"""Which reward exact/* measure (issue 34 item 5): with reward.function set on the embedded prompts, exact/score_mean,
exact/opt_* and exact/objective* are about that function (the training reward), scored once per response per run,
and the task's correctness is reported beside it as exact/gold_mean."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from tether.tasks import digitsum
from tether.tasks.exact import enumerate_policy

# a verl-style batch function: 1 for a response that starts with '1', else 0; each call appends its size to a file
STARTS_WITH_1 = """import json, os
def reward(data_sources, solution_strs, ground_truths, extra_infos):
    with open(os.environ["TETHER_TEST_CALLS"], "a") as f:
        f.write(json.dumps(len(solution_strs)) + "\\n")
    return [float(s.startswith("1")) for s in solution_strs]
"""


def _trainer(small_cfg, tmp_path, monkeypatch, *overrides):
    from tether.trainer import Trainer

    fn = tmp_path / "r.py"
    fn.write_text(STARTS_WITH_1)
    monkeypatch.setenv("TETHER_TEST_CALLS", str(tmp_path / "calls.jsonl"))
    return Trainer(small_cfg("trainer.report=false", f"reward.function={fn}:reward", *overrides))


def _by_hand(t, beta):
    """Per val prompt, from the enumerated distributions: E_π[r], E_π[gold], E_π*[r], the objective and its optimum."""
    model, ref, tok = t.roles.actor.model, t.roles.ref.module, t.roles.tokenizer
    out = []
    for prompt in dict.fromkeys(r.prompt for r in t.val_set.rows):
        k, s = digitsum.parse_prompt(prompt)
        pi = enumerate_policy(model, tok, prompt, k + 1, 1.0)
        rf = enumerate_policy(ref, tok, prompt, k + 1, 1.0)
        r = np.array([float(x.startswith("1")) for x in pi.texts])
        gold = np.array([digitsum.compute_score(x, f"{k},{s}") for x in pi.texts])
        p, q = np.exp(pi.logprobs), np.exp(rf.logprobs)
        kl = float(np.sum(p * (pi.logprobs - rf.logprobs)))
        w = q * np.exp(r / beta)  # π* ∝ π_ref·exp(r/β)
        out.append(
            {
                "score_mean": float(p @ r),
                "gold_mean": float(p @ gold),
                "opt_score_mean": float(w @ r / w.sum()),
                "objective": float(p @ r) - beta * kl,
                "opt_objective": beta * math.log(float(w.sum())),
            }
        )
    return {key: float(np.mean([d[key] for d in out])) for key in out[0]}


def test_exact_metrics_score_the_user_reward_function_and_report_correctness_as_the_gold(
    small_cfg, tmp_path, monkeypatch
):
    t = _trainer(small_cfg, tmp_path, monkeypatch)
    with torch.no_grad():  # a policy other than the reference, so E_π[r] is not E_ref[r]
        t.roles.actor.model.lm_head.weight.mul_(1.7)
    m = t.maybe_validate(force=True)
    want = _by_hand(t, beta=0.05)
    for key, v in want.items():
        assert m[f"exact/{key}"] == pytest.approx(v, abs=1e-9), key
    assert want["score_mean"] != pytest.approx(want["gold_mean"], abs=1e-3)  # two different rewards: the test can fail
    assert m["exact/unscored_mass"] == 0.0  # the function scored every response
    # exact/*: one batched call per prompt (the 4 val prompts all have k = 3), of its distinct response texts: the
    # strings of at most 4 of the 12 visible tokens (<pad> and <s> decode to nothing), 1 + 12 + 12² + 12³ + 12⁴ =
    # 22,621 of the 41,371 responses; cached, so the second validation calls it only for its 4 × 2 samples
    t.maybe_validate(force=True)
    calls = [json.loads(x) for x in (tmp_path / "calls.jsonl").read_text().splitlines()]
    assert {r.prompt[0] for r in t.val_set.rows} == {"3"} and len(t.val_set.rows) == 4
    assert calls == [8, 22_621, 22_621, 22_621, 22_621, 8]


def test_without_a_user_reward_exact_measures_the_task_reward_and_logs_no_gold(small_cfg):
    from tether.trainer import Trainer

    t = Trainer(small_cfg("trainer.report=false"))
    m = t.maybe_validate(force=True)
    assert "exact/score_mean" in m and "exact/gold_mean" not in m and "exact/unscored_mass" not in m


def test_a_user_gold_is_the_exact_gold(small_cfg, tmp_path, monkeypatch):
    # reward.val_function beside reward.function: exact/gold_mean is that gold's exact mean (a constant 0.25: Σ π = 1)
    g = tmp_path / "g.py"
    g.write_text(
        "def gold(data_sources, solution_strs, ground_truths, extra_infos):\n    return [0.25] * len(solution_strs)\n"
    )
    t = _trainer(small_cfg, tmp_path, monkeypatch, f"reward.val_function={g}:gold")
    m = t.maybe_validate(force=True)
    assert m["exact/gold_mean"] == pytest.approx(0.25, abs=1e-12) and m["exact/gold_unscored_mass"] == 0.0
    assert m["exact/score_mean"] == pytest.approx(_by_hand(t, beta=0.05)["score_mean"], abs=1e-9)
