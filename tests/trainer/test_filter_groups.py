"""algo.filter_groups (DAPO dynamic sampling) and the no-learning-signal check, end to end on the embedded task."""

import logging

import pytest

from tether.diagnostics import doctor
from tether.trainer import Trainer

pytestmark = pytest.mark.slow


def test_filter_groups_trains_only_on_prompts_whose_rewards_differ(small_cfg):
    # n = 2 samples per prompt from a reference right about half of the time: about half the prompts are flat
    t = Trainer(small_cfg("rollout.n=2", "algo.filter_groups=true", "algo.mini_batch_size=8", "trainer.val_freq=0"))
    history = t.fit()
    for rec in history:
        assert rec["rollout/responses"] == 8.0  # data.batch_size=4 prompts x 2, whatever was drawn
        assert rec["rollout/prompts_drawn"] == 4 * rec["rollout/draws"]
        assert rec["rollout/filter_exhausted"] == 0.0 and rec["rollout/zero_var_group_frac"] == 0.0
        assert rec["rollout/filtered_groups"] <= rec["rollout/prompts_drawn"] - 4
    assert any(rec["rollout/draws"] > 1 for rec in history)  # this seed drew extra prompts
    # the sampler's (checkpointed) position counts every prompt drawn: 8 prompts per epoch
    assert t.sampler.epoch * 8 + t.sampler.index == sum(rec["rollout/prompts_drawn"] for rec in history)


ZERO_REWARD = """
def reward(data_sources, solution_strs, ground_truths, extra_infos):
    return [0.0 for _ in solution_strs]
"""


def test_a_run_that_learns_nothing_is_reported_live_and_by_the_doctor(small_cfg, tmp_path, caplog, capsys):
    fn = tmp_path / "zero.py"
    fn.write_text(ZERO_REWARD)
    run = tmp_path / "run"
    cfg = small_cfg(
        f"reward.function={fn}:reward",
        "algo.filter_groups=true",
        "algo.filter_groups_max_draws=2",
        "trainer.total_steps=10",
        "trainer.val_freq=0",
        "trainer.save_freq=0",
        "trainer.report=false",
        out=run,
    )
    with caplog.at_level(logging.WARNING, logger="tether"):
        history = Trainer(cfg).fit()
    assert len(history) == 10
    # never a prompt whose samples differ: two draws of 4 prompts, all dropped, the last one trained on
    for rec in history:
        assert (
            rec["rollout/draws"],
            rec["rollout/prompts_drawn"],
            rec["rollout/filtered_groups"],
            rec["rollout/filter_exhausted"],
        ) == (2, 8, 8, 1)
        assert rec["rollout/zero_var_group_frac"] == 1.0
        assert rec["advantages/abs_mean"] == 0.0 and rec["policy/grad_norm"] == 0.0  # π = π_ref: KL 0, nothing to learn
    assert (
        "algo.filter_groups: after 2 draws (algo.filter_groups_max_draws=2) only 0 of data.batch_size=4 prompts"
        in caplog.text
    )
    assert (
        "doctor: no learning signal over steps 1–10: 100% of prompts got the same reward for all their samples"
        in caplog.text
    )
    assert doctor(run) == 1
    out = capsys.readouterr().out
    assert "[warning] no_learning_signal (rollout/zero_var_group_frac)" in out
    # the advice names the run's own settings (issue 33): more samples per prompt, or more draws
    assert "rollout.n (now 4) so that samples differ" in out and "raise algo.filter_groups_max_draws (now 2)" in out
