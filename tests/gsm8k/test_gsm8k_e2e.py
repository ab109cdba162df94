"""End to end on GSM8K-format data with a tiny Qwen2 model and a chat template: GRPO (online) and
offline RLHF (dataset scores, and rewards computed by the GSM8K reward function)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tether.config import load_config
from tether.data import load_rows
from tether.rewards import gsm8k_compute_score
from tether.trainer import Trainer

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "gsm8k.yaml"

# The real config, shrunk to seconds on one CPU core.
TINY = [
    "actor.dtype=float32",
    "actor.gradient_checkpointing=false",
    "actor.micro_batch_size=16",
    "actor.lr=1e-3",
    "actor.warmup_steps=0",
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

# A batch reward function: GSM8K correctness plus a small bonus for digits, so that a random model's
# responses get different rewards and GRPO has non-zero advantages to learn from.
REWARD_FN = """
from tether.rewards import gsm8k_compute_score

def gsm8k_plus_digits(data_sources, solution_strs, ground_truths, extra_infos):
    return [gsm8k_compute_score(s, g) + 0.1 * sum(c.isdigit() for c in s) / max(len(s), 1)
            for s, g in zip(solution_strs, ground_truths)]
"""


def _trainer(qwen2_dir, tmp_path, *overrides):
    cfg = load_config(CONFIG, [f"actor.model={qwen2_dir}", f"trainer.output_dir={tmp_path / 'run'}", *TINY, *overrides])
    trainer = Trainer(cfg)
    batches = []
    score = trainer.score

    def capture(batch):
        score(batch)
        batches.append(batch)

    trainer.score = capture
    return trainer, batches


def test_config_file_is_a_real_model_config():
    cfg = load_config(CONFIG)
    assert cfg.rollout.max_new_tokens == 512 and cfg.rollout.n == 8
    # fp32 master weights
    assert cfg.algo.adv_estimator == "grpo" and (cfg.actor.dtype, cfg.actor.compute_dtype) == ("float32", "bfloat16")
    assert cfg.data.train_files.endswith(".parquet") and cfg.data.val_files.endswith(".parquet")
    assert cfg.actor.model.startswith("/path/to/")  # a placeholder the user replaces


@pytest.mark.slow
def test_grpo_on_gsm8k(qwen2_dir, gsm8k_files, tmp_path):
    fn = tmp_path / "reward_fn.py"
    fn.write_text(REWARD_FN)
    trainer, batches = _trainer(
        qwen2_dir,
        tmp_path,
        f"data.train_files={gsm8k_files['train']}",
        f"data.val_files={gsm8k_files['val']}",
        f"reward.function={fn}:gsm8k_plus_digits",
    )
    before = {k: v.clone() for k, v in trainer.roles.actor.model.state_dict().items()}
    history = trainer.fit()
    assert len(history) == 2 and len(batches) == 2
    rows = load_rows(gsm8k_files["train"])
    for batch in batches:
        assert len(batch) == 8 and batch.group_ids.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
        # prompts went through the Qwen2 chat template, with the instruction suffix of the converter
        for p in batch.prompts:
            assert p.startswith("<|im_start|>user\n") and p.endswith("<|im_end|>\n<|im_start|>assistant\n")
            assert 'output the final answer after "####"' in p
        assert batch.prompts[0] in {trainer.train_set.texts[i] for i in range(len(rows))}
        lengths = batch.response_mask.sum(-1)
        assert int(lengths.max()) > 1 and int(lengths.max()) <= 24
        # the mask ends at (and includes) the first EOS; padding after it is the pad token
        for ids, m in zip(batch.response_ids.tolist(), batch.response_mask.tolist(), strict=True):
            n = sum(m)
            if 2 in ids:
                assert ids.index(2) == n - 1 and all(t == 0 for t in ids[n:])
        # the sequence scores are the reward function's on the decoded responses
        expected = [
            gsm8k_compute_score(r, row.ground_truth) + 0.1 * sum(c.isdigit() for c in r) / max(len(r), 1)
            for r, row in zip(batch.responses, batch.rows, strict=True)
        ]
        assert batch.scores.tolist() == pytest.approx(expected, abs=1e-6)
        assert batch.old_logprobs.shape == batch.response_ids.shape
        assert bool((batch.old_logprobs[batch.response_mask.bool()] < 0).all())
    after = trainer.roles.actor.model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before), "GRPO did not update the actor"
    val = history[-1]
    assert val["val/prompts"] == 4.0 and 0.0 <= val["val/pass@1"] <= val["val/pass@2"] <= 1.0
    assert 1.0 < val["val/length_mean"] <= 24.0 and math.isfinite(val["val/distinct_1"])
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if x["step"] >= 1] == [1, 2]  # (a step-0 line holds the initial validation)


@pytest.mark.slow
@pytest.mark.parametrize("scored_by", ["dataset", "reward_function"])
def test_offline_on_gsm8k_solutions(qwen2_dir, gsm8k_files, tmp_path, scored_by):
    """Offline RLHF on labelled model solutions: complete groups of four per question, the dataset's
    responses unchanged, scores from the score column or from the GSM8K reward (which agrees with the
    labels), and updates on the fixed responses."""
    score_key = ["data.score_key=score"] if scored_by == "dataset" else []
    trainer, batches = _trainer(
        qwen2_dir,
        tmp_path,
        f"data.train_files={gsm8k_files['offline']}",
        f"data.val_files={gsm8k_files['val']}",
        "rollout.mode=offline",
        "data.response_key=response",
        *score_key,
        "rollout.max_new_tokens=512",
        "data.instruction_suffix=",
    )
    before = {k: v.clone() for k, v in trainer.roles.actor.model.state_dict().items()}
    history = trainer.fit()
    labelled = {}
    for row in load_rows(gsm8k_files["offline"], response_key="response", score_key="score"):
        labelled[(row.extra_info["question"], row.response)] = row.score
    for batch in batches:
        # each of the 2 sampled rows brings its question's 4 solutions (one group when both rows
        # belong to the same question), whatever the shuffling
        n_groups = len(batch) // 4
        assert n_groups in (1, 2) and batch.group_ids.tolist() == [g for g in range(n_groups) for _ in range(4)]
        assert len({batch.prompts[j] for j in range(len(batch))}) == n_groups
        assert all(len({batch.prompts[j] for j in range(4 * g, 4 * g + 4)}) == 1 for g in range(n_groups))
        for row, text in zip(batch.rows, batch.responses, strict=True):
            assert text == row.response  # the dataset's text, not a generated one
        labels = [labelled[(r.extra_info["question"], r.response)] for r in batch.rows]
        assert batch.scores.tolist() == labels
        assert 0.0 < sum(labels) < len(labels)
        # every response ends with EOS (none hit 512 tokens)
        last = batch.response_mask.sum(-1) - 1
        assert batch.response_ids.gather(1, last.unsqueeze(1)).squeeze(1).tolist() == [2] * len(batch)
        assert int(batch.response_mask.sum(-1).min()) > 20
    rec = history[0]
    assert rec["reward/dataset_score_count" if scored_by == "reward_function" else "reward/invalid_count"] == 0.0
    assert math.isfinite(rec["policy/pg_loss"]) and rec["policy/grad_norm"] > 0
    after = trainer.roles.actor.model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    # validation generates from the policy and scores with the GSM8K reward (no score column there)
    assert history[-1]["val/prompts"] == 4.0 and history[-1]["val/length_mean"] <= 512


def test_cli_converts_model_solutions(gsm8k_dir, tmp_path, capsys):
    from tether.cli import main

    src = tmp_path / "sol.jsonl"
    src.write_text("".join(open(gsm8k_dir / "example_model_solutions.jsonl").readlines()[:3]))
    assert main(["data", "gsm8k-solutions", str(src), str(tmp_path / "out.jsonl")]) == 0
    assert "wrote 12 rows" in capsys.readouterr().out
    rows = load_rows(tmp_path / "out.jsonl", response_key="response", score_key="score")
    first = json.loads(src.read_text().splitlines()[0])
    assert len(rows) == 12 and rows[0].response == first["6b_finetuning"]["solution"]
    assert [r.score for r in rows[:4]] == [
        float(first[m]["is_correct"])
        for m in ("6b_finetuning", "6b_verification", "175b_finetuning", "175b_verification")
    ]
    assert main(["data", "gsm8k-solutions", str(tmp_path / "missing.jsonl"), str(tmp_path / "x.jsonl")]) == 2


# GSM8K correctness as the built-in scores it, with verl's format_score: 1 for the right final answer, 0.1 for a wrong
# one that was found (a number in the response), 0 for none; a random tiny model writes numbers now and then, so the
# reward term is not identically 0
FORMAT_REWARD_FN = """
from tether.rewards import gsm8k_compute_score

def gsm8k_with_format(data_sources, solution_strs, ground_truths, extra_infos):
    return [gsm8k_compute_score(s, g, format_score=0.1) for s, g in zip(solution_strs, ground_truths)]
"""


@pytest.mark.slow
def test_distillation_mixed_with_the_task_reward_and_the_reference_kl(qwen2_dir, gsm8k_files, tmp_path):
    """One run with all three terms of J = E[r] − β·KL(π‖π_ref) − λ·KL(π‖π_T) on GSM8K rows: the task reward (GSM8K
    correctness), the reference KL (β = 0.05, k1, in the reward) and a teacher (the tiny model trained 3 steps further
    by tether and exported). Each token's reward is then worked out by hand from the batch's log-probs and scores:
    score·[t = last] − β·(log π_old − log π_ref) − λ·(log π_old − log π_T), and each of the three is non-zero on the
    run (float32: the trainer subtracts the same numbers in another order, so to 1e-6)."""
    from tether.export import export_checkpoint

    fn = tmp_path / "reward_fn.py"
    fn.write_text(FORMAT_REWARD_FN)
    data = [f"data.train_files={gsm8k_files['train']}", f"data.val_files={gsm8k_files['val']}"]
    reward = f"reward.function={fn}:gsm8k_with_format"
    pre = tmp_path / "pre"
    pre.mkdir()
    teacher_run, _ = _trainer(qwen2_dir, pre, *data, reward, "trainer.total_steps=3", "trainer.val_freq=0")
    teacher_run.fit()
    teacher = export_checkpoint(pre / "run", tmp_path / "teacher")
    beta, lam = 0.05, 0.5
    trainer, batches = _trainer(
        qwen2_dir,
        tmp_path,
        *data,
        reward,
        f"kl.coef={beta}",
        "kl.placement=reward",
        "kl.estimator=k1",
        f"distill.teacher={teacher}",
        f"distill.coef={lam}",
        "trainer.total_steps=3",
        "trainer.val_freq=0",
    )
    history = trainer.fit()
    assert len(history) == 3
    for batch in batches:
        mask = batch.action_mask.bool()
        last = mask.cumsum(-1) == mask.sum(-1, keepdim=True)  # the last response token
        k1_ref = batch.old_logprobs - batch.ref_logprobs
        k1_teacher = batch.old_logprobs - batch.teacher_logprobs
        want = torch.where(mask, -beta * k1_ref - lam * k1_teacher, 0.0) + torch.where(
            mask & last, batch.scores[:, None], 0.0
        )
        assert batch.token_level_rewards == pytest.approx(want, abs=1e-6)
    # each term live on the run: scores that vary, log-ratios to the reference once the policy moved (step 1 samples
    # from the reference's weights: exactly 0) and to the teacher at every step; their metrics logged
    assert max(float(b.scores.max()) for b in batches) > 0
    m = [b.action_mask.bool() for b in batches]
    assert float((batches[0].old_logprobs - batches[0].ref_logprobs)[m[0]].abs().max()) == 0.0
    assert float((batches[-1].old_logprobs - batches[-1].ref_logprobs)[m[-1]].abs().max()) > 1e-3
    assert all(
        float((b.old_logprobs - b.teacher_logprobs)[k].abs().max()) > 1e-2 for b, k in zip(batches, m, strict=True)
    )
    for h in history:
        print({k: h[k] for k in ("reward/score_mean", "kl/ref_mean", "distill/kl_student_teacher_seq")})
        assert h["kl/coef"] == beta and h["distill/coef"] == lam and h["distill/kl_student_teacher_seq"] != 0
