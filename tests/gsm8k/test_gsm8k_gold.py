"""The gold reward of validation on the GSM8K path (issue 23 item 1): the real GSM8K config with a tiny Qwen2,
trained on the built-in GSM8K reward and validated with a reward.val_function gold too (skipped cleanly
when ../shared/data/gsm8k is absent)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tether.config import load_config
from tether.trainer import Trainer

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "gsm8k.yaml"
TINY = [
    "actor.dtype=float32",
    "actor.gradient_checkpointing=false",
    "actor.micro_batch_size=16",
    "data.batch_size=2",
    "rollout.n=4",
    "rollout.max_new_tokens=24",
    "algo.mini_batch_size=8",
    "trainer.total_steps=2",
    "trainer.val_freq=2",
    "trainer.val_n=2",
    "trainer.save_freq=0",
    "trainer.progress=false",
    "trainer.threads=1",
    "trainer.report=false",
    "trainer.loggers=[jsonl]",
]
# the share of a response's characters that are digits: a gold whose every value can be recomputed from the samples
DIGITS = (
    "def gold(data_sources, solution_strs, ground_truths, extra_infos):\n    return [sum(c.isdigit() for c in s) / "
    "max(len(s), 1) for s in solution_strs]\n"
)


def test_gsm8k_validation_reports_the_gold(qwen2_dir, gsm8k_files, tmp_path):
    from tether.evaluation.sampled import evaluate_prompts
    from tether.rewards import gsm8k_compute_score

    (tmp_path / "gold.py").write_text(DIGITS)
    cfg = load_config(
        CONFIG,
        [
            f"actor.model={qwen2_dir}",
            f"trainer.output_dir={tmp_path / 'run'}",
            *TINY,
            f"data.train_files={gsm8k_files['train']}",
            f"data.val_files={gsm8k_files['val']}",
            f"reward.val_function={tmp_path / 'gold.py'}:gold",
        ],
    )
    t = Trainer(cfg)
    samples: list[dict] = []
    m = evaluate_prompts(
        t.roles.engine, t.roles.reward, t.val_set, n=2, batch_size=4, samples=samples, gold=t.roles.gold
    )
    # each score as the reward returned it, in float32 (RewardResult.raw_scores), as the training reward's
    digits = [
        float(torch.tensor(sum(c.isdigit() for c in s["response"]) / max(len(s["response"]), 1), dtype=torch.float32))
        for s in samples
    ]
    assert [s["gold"] for s in samples] == digits and {s["data_source"] for s in samples} == {"openai/gsm8k"}
    assert 0 < sum(digits) and all(s["gold_scored"] for s in samples)
    truth = {r.index: r.ground_truth for r in t.val_set.rows}  # the training reward is GSM8K's own
    assert [s["score"] for s in samples] == [gsm8k_compute_score(s["response"], truth[s["index"]]) for s in samples]
    by_prompt = [digits[i : i + 2] for i in range(0, len(digits), 2)]
    assert m["gold_mean"] == pytest.approx(math.fsum(math.fsum(p) / 2 for p in by_prompt) / len(by_prompt), abs=1e-15)
    assert m["gold_gap"] == m["score_mean"] - m["gold_mean"] and m["gold_unscored_frac"] == 0.0
    v = t.maybe_validate(force=True)
    assert v["val/gold_gap"] == v["val/score_mean"] - v["val/gold_mean"] and 0.0 <= v["val/gold_mean"] <= 1.0
