"""Runs that train no token, step after step, stop as an all-failing reward does (issue 33): reward.max_failed_steps
steps in a row whose every token algo.mask_truncated or algo.rollout_correction's rejection took out of the loss stop
the run (exit 3 in tether train, guard/nothing_trained), naming the setting; a shorter run ends with that error."""

import json

import pytest

from tether.cli import main
from tether.trainer import Trainer, TrainingStopped

QUIET = ["trainer.val_freq=0", "trainer.report=false"]
# every digit-sum response is 3 digits and EOS: 2 new tokens cut every one of them
ALL_TRUNCATED = ["algo.mask_truncated=true", "rollout.max_new_tokens=2"]
# the engine samples at 1.5, the trainer's log-probs are at 1.0: every response's summed k2 is far above 1e-6 nats
ALL_REJECTED = [
    "rollout.engine_temperature=1.5",
    "algo.rollout_correction.reject=seq_sum_k2",
    "algo.rollout_correction.reject_threshold=1e-6",
]


def lines(run) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(
    "overrides, named",
    [
        (ALL_TRUNCATED, r"algo\.mask_truncated=true took every response out of the loss .*rollout\.max_new_tokens=2"),
        (ALL_REJECTED, r"algo\.rollout_correction\.reject=seq_sum_k2 rejected every token \(reject_threshold=1e-06\)"),
    ],
    ids=["mask_truncated", "rejection"],
)
def test_steps_that_train_no_token_stop_after_max_failed_steps(small_cfg, tmp_path, overrides, named):
    t = Trainer(small_cfg(*QUIET, *overrides, "trainer.total_steps=6"))
    with pytest.raises(TrainingStopped, match=r"step 3: no token was trained for 3 steps in a row .*" + named):
        t.fit()
    assert t.step == 3
    last = lines(tmp_path / "run")[-1]
    assert last["step"] == 3 and last["guard/nothing_trained"] == 1.0 and last["guard/stop"] == 1.0


def test_a_step_that_trains_resets_the_count(small_cfg):
    t = Trainer(small_cfg(*QUIET, "trainer.total_steps=2"))
    t.guard.check_trained(1, "algo.mask_truncated=true took every response out of the loss")
    t.guard.check_trained(2, "algo.mask_truncated=true took every response out of the loss")
    t.guard.check_trained(3, "")
    assert (t.guard.untrained_streak, t.guard.untrained_why) == (0, "")
    t.roles.close()


def test_a_short_run_that_trains_nothing_ends_with_exit_3(tmp_path, capsys):
    out = tmp_path / "short"
    rc = main(
        [
            "train",
            *QUIET,
            *ALL_TRUNCATED,
            "trainer.total_steps=2",
            "trainer.progress=false",
            "trainer.threads=1",
            "data.batch_size=4",
            "data.embedded_train_size=8",
            "rollout.n=4",
            "algo.mini_batch_size=8",
            f"trainer.output_dir={out}",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 3
    assert "stopped by a guard: no token of all 2 step(s) of this run was trained: algo.mask_truncated=true" in err
    assert (out / "checkpoints").is_dir()
