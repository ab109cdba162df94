"""Absurd learning rates (issue 24, item 8): a step is never left half applied, and repeated non-finite steps stop the
run
with a clear error instead of a crash in sampling."""

import pytest
import torch
from test_rollout_correction import _actor, _prepared_batch
from test_rollout_correction import (
    _spec as rollout_spec,  # tests/trainer is on sys.path (rootdir-less prepend import)
)

from tether.cli import main
from tether.config import GuardConfig
from tether.trainer.guards import GuardMonitor, TrainingStopped
from tether.workers.actor import ActorUpdateSpec


def _spec(**kw) -> ActorUpdateSpec:
    """Two mini-batches of 8, no KL loss."""
    return rollout_spec(**({"mini_batch_size": 8, "kl_loss_coef": 0.0} | kw))


def _state(actor):
    opt = actor.optimizer.state_dict()
    return (
        [p.detach().clone() for p in actor.model.parameters()],
        {k: {n: v.clone() for n, v in st.items()} for k, st in opt["state"].items()},
        actor.scheduler.state_dict(),
        [g["lr"] for g in opt["param_groups"]],
    )


@pytest.mark.parametrize("atomic", [True, False])
def test_a_step_whose_later_mini_batch_turns_non_finite_is_undone_whole(small_cfg, tmp_path, atomic):
    """Two mini-batches of 8 (the shuffle puts rows 0..7 of the permutation first); the second has an infinite
    advantage.
    guard.atomic_update undoes the first mini-batch's applied update too: weights, AdamW state and LR schedule as
    before."""
    batch = _prepared_batch(small_cfg, tmp_path)
    # mini_batches' order at step 2
    perm = torch.randperm(len(batch), generator=torch.Generator().manual_seed(0 * 1_000_003 + 2))
    batch.advantages[perm[8:]] = float("inf")
    actor = _actor()
    actor.update(batch.select(list(range(len(batch)))), _spec(), step=1)  # one finite step first: AdamW state exists
    before = _state(actor)
    out = actor.update(batch, _spec(atomic_update=atomic), step=2)
    after = _state(actor)
    assert out["guard/nonfinite_skip"] == (2.0 if atomic else 1.0) and out["policy/updates"] == (0.0 if atomic else 1.0)
    same = all(torch.equal(a, b) for a, b in zip(before[0], after[0], strict=True))
    assert same == atomic
    if atomic:
        assert out["guard/undone_updates"] == 1.0 and after[2] == before[2] and after[3] == before[3]
        assert all(
            torch.equal(before[1][k][n], after[1][k][n]) for k in before[1] for n in ("exp_avg", "exp_avg_sq", "step")
        )


def test_non_finite_weights_stop_without_a_checkpoint_of_them():
    g = GuardMonitor(GuardConfig())
    with pytest.raises(
        TrainingStopped,
        match=r"step 4: the update left 12 non-finite weight\(s\) \(actor.lr=0.3: .*the latest complete checkpoint",
    ) as e:
        g.check_update(4, {"guard/nonfinite_weights": 12.0}, lr=0.3)
    assert e.value.save is False


@pytest.mark.slow
def test_an_absurd_learning_rate_stops_cleanly_after_max_nonfinite_steps(tmp_path, capsys):
    """actor.lr=1e10 crashed in sampling ("probability tensor contains either inf, nan") after applying a half step."""
    run = tmp_path / "run"
    rc = main(
        [
            "train",
            "actor.lr=1e10",
            "trainer.total_steps=6",
            "trainer.val_freq=0",
            "trainer.progress=false",
            "data.batch_size=4",
            "rollout.n=4",
            "algo.mini_batch_size=8",
            "data.embedded_train_size=8",
            f"trainer.output_dir={run}",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 3, err
    assert (
        "tether train: stopped by a guard: step 3: a non-finite loss or gradient in 3 steps in a row "
        "(guard.max_nonfinite_steps=3; actor.lr=1e+10): the run is not learning; lower actor.lr or check the data and "
        "reward"
    ) in err
    # undone whole: the weights are sound
    assert "Traceback" not in err and (run / "checkpoints" / "step_000003").is_dir()
