"""``tether train data.embedded_task=digitsum_tool`` (issue 30's done-when): the multi-turn task trains from its own
reference, logs ``agent/*`` and the exact ``exact/*`` of its enumerated trajectories at validation."""

import json
from pathlib import Path

import pytest


@pytest.mark.slow
def test_the_tool_task_trains_and_logs_agent_and_exact_trajectory_metrics(small_cfg):
    from tether.trainer import Trainer

    cfg = small_cfg("data.embedded_task=digitsum_tool", "trainer.total_steps=1", "trainer.val_freq=1")
    assert cfg.agent.environment == "tether.agents.digitsum_tool:DigitSumToolEnvironment" and cfg.agent.max_turns == 2
    t = Trainer(cfg)
    (m,) = t.fit()
    # the task's own reference calls the tool: every turn-1 call gets a second turn (2 turns at most)
    assert m["agent/tool_calls"] > 0 and 1.0 < m["agent/turns_mean"] <= 2.0
    assert m["agent/tool_errors"] == 0.0 and m["agent/env_errors"] == 0.0 and m["agent/prefix_mismatch"] == 0.0
    assert 0.0 < m["agent/observation_frac"] < 1.0
    # the reward is the environment's per turn (the data source's built-in score is 0, so nothing counts twice)
    assert m["reward/score_mean"] == 0.0 and 0.0 <= m["reward/turn_reward_mean"] <= 1.0
    lines = (Path(cfg.trainer.output_dir) / "metrics.jsonl").read_text().splitlines()
    records = [r for r in map(json.loads, lines) if "exact/tool_call_rate" in r]
    step0 = next(r for r in records if r["step"] == 0)
    # at step 0 the policy is the reference, enumerated by the same code: its KL to itself is 0, its numbers the ref's
    assert step0["exact/kl_ref_seq"] == 0.0
    assert step0["exact/tool_call_rate"] == step0["exact/ref_tool_call_rate"]
    assert step0["exact/score_mean"] == step0["exact/ref_score_mean"]
    # the tool reveals s, so π*_β calls more than the reference and scores higher; the gap is π*'s objective less ours
    assert step0["exact/opt_tool_call_rate"] > step0["exact/tool_call_rate"]
    assert step0["exact/opt_score_mean"] > step0["exact/score_mean"]
    assert step0["exact/objective_gap"] == pytest.approx(step0["exact/opt_objective"] - step0["exact/objective"])
    assert any(r["step"] == 1 for r in records)


def test_tether_eval_of_a_tool_task_run_runs_the_agent_loop_and_enumerates_trajectories(small_cfg, monkeypatch, capsys):
    """``tether eval RUN embedded`` on a digitsum_tool run: the run's environment runs every trajectory (agent/*),
    scores are the environment's turn rewards (the built-in score is 0), and exact/* come from the trajectory
    enumeration of the evaluated rows (recorded here; tests/tasks covers its numbers), not the single-turn parser."""
    import tether.evaluation.evaluate as ev
    from tether.cli import main
    from tether.trainer import Trainer

    cfg = small_cfg("data.embedded_task=digitsum_tool", "trainer.total_steps=1", "trainer.val_freq=0")
    Trainer(cfg).fit()
    seen = []

    def enumerated(policy, ref, tok, rows, beta, **kw):
        seen.append([r["extra_info"]["s"] for r in rows])
        return {"exact/score_mean": 0.5}

    monkeypatch.setattr(ev, "evaluate_tool_policy", enumerated)
    out = Path(cfg.trainer.output_dir) / "eval.json"
    rc = main(
        ["eval", cfg.trainer.output_dir, "embedded", "--n", "2", "--limit", "2", "--no-progress", "--out", str(out)]
    )
    assert rc == 0, capsys.readouterr().err
    from tether.tasks import digitsum_tool

    val = list({r["prompt"]: r for r in digitsum_tool.make_dataset("val")}.values())[:2]
    assert seen == [[r["extra_info"]["s"] for r in val]] * len(seen) and seen
    text = out.read_text()
    assert '"agent/turns_mean"' in text and '"turn_reward_mean"' in text and '"exact/score_mean": 0.5' in text
