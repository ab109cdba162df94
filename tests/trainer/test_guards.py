"""Guards: KL explosions, non-finite values, target-KL early stop and rollback.

Unit tests of GuardMonitor's decisions first (no model), then injected faults in real runs of the
tiny model: a huge learning rate for one step, NaN rewards from a user reward function, NaN
advantages and KL, and a scripted validation drop that forces rollbacks.
"""

import json
import logging
import math
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from tether.config import ConfigError, GuardConfig, load_config
from tether.trainer import Trainer, TrainingStopped
from tether.trainer.guards import GuardMonitor

# ------------------------------------------------------------------------------------ unit tests

FINITE = torch.tensor([1.0, 0.0])


def test_kl_below_max_updates_and_logs_nothing(caplog):
    g = GuardMonitor(GuardConfig(max_kl=0.5))
    assert g.before_update(1, 0.49, FINITE, beta=0.1) == "update"
    assert g.pop_metrics() == {"guard/coef_scale": 1.0, "guard/rollbacks": 0.0}
    assert "guard/" not in caplog.text


@pytest.mark.parametrize("action, expected, scale", [("raise_coef", "update", 3.0), ("skip", "skip", 1.0)])
def test_kl_above_max(caplog, action, expected, scale):
    g = GuardMonitor(GuardConfig(max_kl=0.5, on_max_kl=action, coef_factor=3.0))
    assert g.before_update(7, 0.8, FINITE, beta=0.1) == expected
    assert g.coef_scale == scale
    assert g.pop_metrics() == {"guard/coef_scale": scale, "guard/rollbacks": 0.0, "guard/kl_explosion": 1.0}
    assert "guard/kl_explosion: step 7: KL to the reference 0.8000 nats/token > guard.max_kl=0.5" in caplog.text
    assert f"guard.on_max_kl={action}" in caplog.text
    if action == "raise_coef":
        assert "β 0.1 → 0.3" in caplog.text
        g.before_update(8, 0.9, FINITE, beta=0.3)
        assert g.coef_scale == 9.0  # compounds


def test_raise_coef_at_beta_zero_says_once_that_it_cannot_act(caplog):
    """kl.coef=0 (the new-user trial: "β 0 → 0" warned on 36 of 40 steps): the first explosion says raise_coef cannot
    raise β = 0 and what would act; later ones are counted (guard/kl_explosion) without a warning line."""
    g = GuardMonitor(GuardConfig(max_kl=0.5, on_max_kl="raise_coef"))
    with caplog.at_level(logging.INFO, logger="tether"):
        for step in (1, 2, 3):
            assert g.before_update(step, 0.8, FINITE, beta=0.0) == "update"
            assert g.pop_metrics()["guard/kl_explosion"] == 1.0
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "step 1" in warnings[0].getMessage()
    assert "β is 0, which guard.on_max_kl=raise_coef cannot raise" in warnings[0].getMessage()
    assert "guard.on_max_kl=skip or stop would act" in warnings[0].getMessage()


def test_raise_coef_raises_a_beta_held_at_the_hacking_floor(caplog):
    """After a hacking rollback at kl.coef=0 the run's β is the floor (0.05) while the controller's is 0: a KL explosion
    under raise_coef takes the run's β to 0.05 × 2 = 0.1 and says so (it had said 0.05 → 0.1 and left β at 0.05)."""
    g = GuardMonitor(GuardConfig(max_kl=0.5, on_max_kl="raise_coef"))
    g.escalate_floor()
    assert g.beta(0.0) == 0.05
    assert g.before_update(4, 0.8, FINITE, beta=g.beta(0.0)) == "update"
    assert g.beta(0.0) == pytest.approx(0.1, rel=1e-12) and g.beta(0.2) == pytest.approx(0.4, rel=1e-12)
    assert "β 0.05 → 0.1 (guard.on_max_kl=raise_coef)" in caplog.text


def test_kl_above_max_stop():
    g = GuardMonitor(GuardConfig(max_kl=0.5, on_max_kl="stop"))
    with pytest.raises(
        TrainingStopped,
        match=r"step 3: KL to the reference 2\.0000 nats/token > guard\.max_kl=0\.5 \(guard\.on_max_kl=stop\)",
    ):
        g.before_update(3, 2.0, FINITE, beta=0.1)
    assert g.stop_record() == {
        "guard/coef_scale": 1.0,
        "guard/rollbacks": 0.0,
        "guard/kl_explosion": 1.0,
        "guard/stop": 1.0,
    }


@pytest.mark.parametrize(
    "kl, scores, what",
    [
        (math.nan, FINITE, "no valid sample left"),
        (math.inf, FINITE, "KL to the reference (inf"),
        (0.1, torch.tensor([1.0, math.nan]), "non-finite scores"),
    ],
)
def test_nonfinite_skips_or_stops(caplog, kl, scores, what):
    g = GuardMonitor(GuardConfig())
    assert g.before_update(2, kl, scores, beta=0.1) == "skip"
    assert g.pop_metrics()["guard/nonfinite"] == 1.0
    assert what in caplog.text and "the update is not applied" in caplog.text
    with pytest.raises(TrainingStopped, match=r"guard\.on_nonfinite=stop"):
        GuardMonitor(GuardConfig(on_nonfinite="stop")).before_update(2, kl, scores, beta=0.1)


def test_after_step_reports_the_updates_own_events(caplog):
    caplog.set_level(logging.INFO, logger="tether")
    g = GuardMonitor(GuardConfig(target_kl=0.01))
    out = g.after_step(
        4, {"guard/early_stop": 1.0, "policy/updates": 2.0, "guard/nonfinite_skip": 1.0, "reward/nonfinite_count": 3.0}
    )
    assert out == {"guard/coef_scale": 1.0, "guard/rollbacks": 0.0, "guard/nonfinite_reward": 3.0}
    assert (
        "guard/early_stop: step 4: policy/approx_kl > guard.target_kl=0.01" in caplog.text
        and "after 2 update(s)" in caplog.text
    )
    assert (
        "guard/nonfinite_skip: step 4: a non-finite loss or gradient norm; 1 mini-batch update(s) not applied"
        in caplog.text
    )
    assert "guard/nonfinite_reward: step 4: 3 non-finite reward(s); those samples were dropped" in caplog.text
    assert g.after_step(5, {"guard/early_stop": 0.0, "guard/nonfinite_skip": 0.0, "reward/nonfinite_count": 0.0}) == {
        "guard/coef_scale": 1.0,
        "guard/rollbacks": 0.0,
    }
    stop = GuardMonitor(GuardConfig(on_nonfinite="stop"))
    with pytest.raises(TrainingStopped, match="1 mini-batch update"):
        stop.after_step(4, {"guard/nonfinite_skip": 1.0, "reward/score_mean": 0.5})
    assert stop.stop_record() == {
        "guard/nonfinite_skip": 1.0,
        "reward/score_mean": 0.5,
        "guard/coef_scale": 1.0,
        "guard/rollbacks": 0.0,
        "guard/nonfinite": 1.0,
        "guard/stop": 1.0,
    }


class _FakeTrainer:
    """Holds what GuardMonitor.after_validation is given (step, validation metrics, ckpt, roles, β)."""

    def __init__(self, guard, fail=False):
        self.guard, self.step, self.last_val, self.restored, self.fail = guard, 0, {}, [], fail
        self.ckpt = SimpleNamespace(root=Path("run/checkpoints"), restore_weights=self._restore)
        opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        self.roles = SimpleNamespace(actor=SimpleNamespace(optimizer=opt, scale_lr=self._scale), critic=None)
        self.beta = 0.05

    def _restore(self, step):
        if self.fail:
            raise ValueError("checkpoint run/checkpoints/step_000002: file optim.pt is missing")
        self.restored.append(step)

    def _scale(self, f):
        for g in self.roles.actor.optimizer.param_groups:
            g["lr"] *= f

    def validate(self, step, score):
        self.step, self.last_val = step, {"val/score_mean": score}
        self.guard.after_validation(self.step, self.last_val, self.ckpt, self.roles, self.beta)


def test_rollback_restores_the_stable_checkpoint_then_stops(caplog):
    g = GuardMonitor(GuardConfig(rollback_drop=0.1, max_rollbacks=2, coef_factor=2.0, rollback_lr_factor=0.5))
    t = _FakeTrainer(g)
    t.validate(2, 0.60)
    assert g.score_at(2) == 0.60 and g.score_at(3) is None
    g.mark_stable(2, 0.60)
    t.validate(4, 0.55)  # within 10%: no rollback, becomes stable
    g.mark_stable(4, 0.55)
    assert (g.stable_step, g.stable_score, t.restored) == (4, 0.55, [])
    t.validate(6, 0.49)  # floor 0.495
    assert (
        t.restored == [4]
        and g.rollbacks == 1
        and g.coef_scale == 2.0
        and t.roles.actor.optimizer.param_groups[0]["lr"] == 0.5
    )
    assert g.score_at(6) is None  # the restored weights are not the ones that scored 0.49
    g.mark_stable(6, g.score_at(6))
    assert g.stable_step == 4
    assert g.pop_metrics() == {"guard/coef_scale": 2.0, "guard/rollbacks": 1.0, "guard/rollback": 1.0}
    assert "restored step 4 (rollback 1/2)" in caplog.text and "learning rates ×0.5 → 0.5" in caplog.text
    assert "(rollback 1/2), β ×2 → 0.1, learning rates" in caplog.text  # 0.05 × 2: the multiplier set β
    t.validate(8, 0.30)
    assert t.restored == [4, 4] and g.coef_scale == 4.0 and t.roles.actor.optimizer.param_groups[0]["lr"] == 0.25
    with pytest.raises(TrainingStopped) as stop:
        t.validate(10, 0.2)
    msg = str(stop.value)
    assert "validation score 0.2000 at step 10 (val/score_mean) is more than guard.rollback_drop=0.1 below" in msg
    assert "stable checkpoint's (step 4: 0.5500" in msg
    assert (
        "already rolled back 2 time(s) (guard.max_rollbacks=2)" in msg
        and str(Path("run/checkpoints/step_000004")) in msg
    )
    assert g.stop_record()["guard/rollback_limit"] == 1.0


def test_a_rollback_message_names_the_limit_that_set_its_floor(caplog):
    """The new-user trial: a floor set by guard.rollback_z (sampling noise) was reported as guard.rollback_drop's.
    Stable 0.70 ± 0.03, now ± 0.03: z = 2 gives 2·0.0424 = 0.085 > 5% of 0.70 = 0.035, so the floor is 0.615."""
    g = GuardMonitor(GuardConfig(rollback_drop=0.05, rollback_z=2.0))
    t = _FakeTrainer(g)
    g.stable_step, g.stable_score, g.stable_sem = 4, 0.70, 0.03
    t.step, t.last_val = 6, {"val/score_mean": 0.5, "val/score_sem": 0.03}
    g.after_validation(6, t.last_val, t.ckpt, t.roles, t.beta)
    want = "more than guard.rollback_z=2 standard errors below the stable checkpoint's (step 4: 0.7000, floor 0.6151)"
    assert want in caplog.text


def test_rollback_without_its_checkpoint_stops_cleanly():
    g = GuardMonitor(GuardConfig())
    t = _FakeTrainer(g, fail=True)
    g.mark_stable(2, 0.6)
    with pytest.raises(
        TrainingStopped, match=r"cannot roll back: checkpoint run/checkpoints/step_000002: file optim\.pt is missing"
    ):
        t.validate(4, 0.1)


def test_rollback_off_and_before_any_stable_checkpoint():
    g = GuardMonitor(GuardConfig(rollback_drop=0.0))
    t = _FakeTrainer(g)
    g.mark_stable(2, 0.6)
    t.validate(4, 0.0)
    g2 = GuardMonitor(GuardConfig())
    t2 = _FakeTrainer(g2)
    t2.validate(2, 0.0)
    assert t.restored == t2.restored == [] and g.rollbacks == g2.rollbacks == 0


def _hacking_trainer(**kw):
    g = GuardMonitor(GuardConfig(on_hacking="rollback", rollback_drop=0.05, **kw))
    t = _FakeTrainer(g)

    def validate(step, score, gold, save=True):
        t.step, t.last_val = step, {"exact/score_mean": score, "exact/gold_mean": gold}
        g.after_validation(step, t.last_val, t.ckpt, t.roles, t.beta)
        if save:
            g.mark_stable(step, g.score_at(step))

    def hacking(step):
        g.on_hacking(step, SimpleNamespace(message="gold fell"), t.ckpt, t.roles, t.beta)

    return g, t, validate, hacking


def test_one_validation_rolls_back_once_to_the_checkpoint_whose_gold_held(caplog):
    # issue 33: at step 60 the score drop (guard/rollback) and the doctor's hacking_gold (guard/hacking_rollback) both
    # rolled back to step 50, whose gold 0.336 was already below the reference's 0.469: two rollbacks, lr × 0.25
    g, t, validate, hacking = _hacking_trainer()
    validate(0, 0.469, 0.469, save=False)  # the reference (no checkpoint at step 0)
    validate(40, 0.70, 0.55)  # gold best 0.55: floor 0.55 - 0.05 * 0.55 = 0.5225
    validate(50, 0.80, 0.336)  # stable by the score, not by the gold
    assert (g.stable_step, g.gold_stable_step, g.gold_best) == (50, 40, 0.55)
    validate(60, 0.70, 0.20, save=False)  # 0.70 < 0.80 - 0.04: the validation rolls back to step 50
    hacking(60)  # the same validation seen by the doctor: not a second rollback, but its target is step 40
    assert t.restored == [50, 40]
    assert (g.rollbacks, g.coef_scale, g.coef_floor) == (1, 2.0, 0.05)
    assert t.roles.actor.optimizer.param_groups[0]["lr"] == 0.5  # halved once, not quartered
    assert g.pop_metrics() == {
        "guard/coef_scale": 2.0,
        "guard/rollbacks": 1.0,
        "guard/rollback": 1.0,
        "guard/coef_floor": 0.05,
    }
    assert "already rolled back (rollback 1/3, not counted again): weights of step 40" in caplog.text
    # a resume from step 60's checkpoint (written after the validation's rollback) replays the finding: still once
    h = GuardMonitor(g.cfg)
    h.load_state_dict(json.loads(json.dumps(g.state_dict())))
    h.on_hacking(60, SimpleNamespace(message="gold fell"), t.ckpt, t.roles, t.beta)
    assert h.rollbacks == 1 and t.restored == [50, 40]


def test_a_hacking_rollback_never_returns_to_a_checkpoint_whose_gold_already_fell():
    g, t, validate, hacking = _hacking_trainer()
    validate(0, 0.469, 0.469, save=False)
    validate(50, 0.80, 0.336)  # below the reference's gold by more than 5% of it (floor 0.44555)
    validate(60, 0.81, 0.20, save=False)
    hacking(60)
    assert t.restored == [] and g.rollbacks == 0 and g.pop_metrics()["guard/hacking_no_rollback"] == 1.0
    validate(70, 0.82, 0.4456)  # just above 0.469 · 0.95 = 0.44555: a target
    validate(80, 0.85, 0.30, save=False)
    hacking(80)
    assert t.restored == [70] and g.rollbacks == 1 and g.pop_metrics()["guard/hacking_rollback"] == 1.0


def test_repeated_hacking_rollbacks_double_beta_from_zero_never_return_to_the_flagged_step_and_stop_naming_them(caplog):
    # issue 34 item 4: at β = 0 every hacking rollback gave β = 0.05 (0 × 2 = 0, floored at guard.hacking_coef)
    g, t, validate, hacking = _hacking_trainer(max_rollbacks=3, coef_factor=2.0, hacking_coef=0.05)
    t.beta = 0.0
    validate(0, 0.469, 0.469, save=False)
    validate(10, 0.60, 0.60)  # gold best 0.60 (floor 0.57): a target
    validate(20, 0.70, 0.30)  # stable by the score, the gold fell
    hacking(20)
    assert t.restored == [10] and g.beta(t.beta) == 0.05 and g.stable_step == 10  # not step 20, the hacked one
    # β did not double (0 × 2 = 0): the message says the floor set it
    assert (
        "β 0 → floor 0.05 (guard.hacking_coef=0.05, × guard.coef_factor=2 per further hacking rollback; the "
        "controller's β 0 × the guard's scale 2 would be 0)" in caplog.text
    )
    assert "β ×2" not in caplog.text
    validate(30, 0.65, 0.62)  # the gold held (best 0.62): checkpoint 30 is a target for later steps...
    assert g.gold_stable_step == 30 and g.protected_steps() == {10, 30}  # pruning keeps the target before 30
    hacking(30)  # ...but not for a finding at step 30 itself: its weights are the ones flagged
    assert t.restored == [10, 10] and g.beta(t.beta) == 0.1 and g.protected_steps() == {10}
    validate(40, 0.70, 0.61)
    hacking(40)
    assert t.restored == [10, 10, 10] and (g.coef_scale, g.coef_floor, g.beta(t.beta)) == (8.0, 0.2, 0.2)
    assert t.roles.actor.optimizer.param_groups[0]["lr"] == 0.125
    assert "β 0.1 → floor 0.2 (guard.hacking_coef=0.05, × guard.coef_factor=2 per further hacking" in caplog.text
    validate(50, 0.70, 0.10, save=False)
    with pytest.raises(TrainingStopped) as stop:
        hacking(50)
    assert (
        "already rolled back 3 time(s) (guard.max_rollbacks=3): step 20 → checkpoint 10 (β 0.05), step 30 → "
        "checkpoint 10 (β 0.1), step 40 → checkpoint 10 (β 0.2)." in str(stop.value)
    )
    assert g.coef_floor == 0.2  # the stop changes nothing
    h = GuardMonitor(g.cfg)
    h.load_state_dict(json.loads(json.dumps(g.state_dict())))
    assert h.tried == [[20, 10, 0.05], [30, 10, 0.1], [40, 10, 0.2]] and h.coef_floor == 0.2


@pytest.mark.parametrize(
    ("beta", "want"),
    [
        (0.01, [0.05, 0.15]),  # max(0.01·3, 0.05), max(0.01·9, 0.05·3)
        (0.2, [0.6, 1.8]),  # the scaled β is above the floor: 0.2·3, 0.2·9
    ],
)
def test_hacking_rollbacks_escalate_a_positive_beta_by_coef_factor(beta, want):
    g, t, validate, hacking = _hacking_trainer(coef_factor=3.0)
    t.beta = beta
    validate(10, 0.6, 0.6)
    got = []
    for step in (20, 30):
        validate(step, 0.6, 0.2, save=False)
        hacking(step)
        got.append(g.beta(t.beta))
    assert got == pytest.approx(want, abs=1e-12) and t.restored == [10, 10]


def test_a_hacking_rollback_without_a_gold_returns_to_the_stable_checkpoint_before_the_flagged_one():
    g = GuardMonitor(GuardConfig(on_hacking="rollback", rollback_drop=0.05))
    t = _FakeTrainer(g)
    for step, score in ((10, 0.60), (20, 0.65)):
        t.validate(step, score)
        g.mark_stable(step, g.score_at(step))
    assert g.stable_step == 20
    g.on_hacking(20, SimpleNamespace(message="KL accelerated"), t.ckpt, t.roles, t.beta)  # hacking_proxy: no gold
    assert t.restored == [10] and g.stable_step == 10 and g.hacking_target(30) == 10


def test_the_gold_floor_allows_for_sampling_noise():
    g = GuardMonitor(GuardConfig(rollback_drop=0.05, rollback_z=2.0))
    t = _FakeTrainer(g)
    g.after_validation(10, {"val/score_mean": 0.5, "val/gold_mean": 0.60, "val/gold_sem": 0.03}, t.ckpt, t.roles, 0.05)
    assert g.gold_score({"val/gold_mean": 0.6, "val/gold_unscored_frac": 1.0}) == (None, 0.0)
    # 5% of 0.60 is 0.03; 2 standard errors of the difference are 2·sqrt(0.03² + 0.03²) = 0.084853
    assert abs(g.gold_floor(0.03) - (0.60 - 2 * (2 * 0.03**2) ** 0.5)) < 1e-12
    assert abs(g.gold_floor(0.0) - (0.60 - 2 * 0.03)) < 1e-12  # the noise of the best alone: 0.06 > 0.03


def test_hacking_rollback_without_checkpoints_is_refused_at_config_time():
    with pytest.raises(ConfigError, match=r"guard.on_hacking=rollback .*trainer.save_freq=0"):
        load_config(None, ["guard.on_hacking=rollback", "trainer.save_freq=0"])
    load_config(None, ["guard.on_hacking=stop", "trainer.save_freq=0"])
    # no validation: no gold check and no stable checkpoint to choose (the new-user trial: it ran and could never act)
    with pytest.raises(ConfigError, match=r"guard.on_hacking=rollback chooses .* trainer.val_freq=0 runs none"):
        load_config(None, ["guard.on_hacking=rollback", "trainer.save_freq=10", "trainer.val_freq=0"])
    load_config(None, ["guard.on_hacking=stop", "trainer.val_freq=0"])
    # a save_freq at or past total_steps also writes only the final checkpoint (the new-user trial's save_freq=500)
    with pytest.raises(
        ConfigError, match=r"trainer.save_freq=20 writes one only at the end \(trainer.total_steps=20\)"
    ):
        load_config(None, ["guard.on_hacking=rollback", "trainer.save_freq=20", "trainer.total_steps=20"])
    load_config(None, ["guard.on_hacking=rollback", "trainer.save_freq=10", "trainer.total_steps=20"])


def test_state_round_trip_and_older_state():
    g = GuardMonitor(GuardConfig())
    g.coef_scale, g.rollbacks, g.stable_step, g.stable_score, g.val_step, g.val_score = 4.0, 2, 6, 0.5, 8, 0.45
    h = GuardMonitor(GuardConfig())
    h.load_state_dict(json.loads(json.dumps(g.state_dict())))
    assert h.state_dict() == g.state_dict()
    h.load_state_dict({"coef_scale": 2.0, "rollbacks": 1, "stable_step": 2, "stable_score": 0.3})
    assert (h.coef_scale, h.val_step, h.val_score) == (2.0, None, None)


# ------------------------------------------------------------------------------------ real runs

BASE = [
    "trainer.progress=false",
    "trainer.threads=1",
    "trainer.report=false",
    "trainer.loggers=[jsonl]",
    "trainer.val_freq=0",
    "trainer.save_freq=0",
    "trainer.resume=off",
    "trainer.total_steps=4",
    "data.batch_size=4",
    "data.embedded_train_size=8",
    "rollout.n=4",
    "algo.mini_batch_size=8",
    "actor.lr=1e-4",
]


def make(tmp_path, *extra) -> Trainer:
    return Trainer(load_config(None, [*BASE, f"trainer.output_dir={tmp_path / 'run'}", *extra]))


def params(t: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in t.roles.actor.model.state_dict().items()}


def assert_finite(t: Trainer) -> None:
    bad = [k for k, v in t.roles.actor.model.state_dict().items() if not torch.isfinite(v).all()]
    assert not bad, bad
    for state in t.roles.actor.optimizer.state.values():
        assert all(torch.isfinite(v).all() for v in state.values() if torch.is_tensor(v))


def same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


def lines(tmp_path) -> list[dict]:
    return [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]


def huge_lr_at(t: Trainer, step: int, lr: float = 0.05) -> None:
    """Inject a KL explosion: one actor update with a huge learning rate."""
    update = t.roles.actor.update

    def patched(batch, spec, s, ref=None, **kw):  # kw: teacher= (distill.teacher)
        if s != step:
            return update(batch, spec, s, ref=ref, **kw)
        groups = t.roles.actor.optimizer.param_groups
        saved = [g["lr"] for g in groups]
        for g in groups:
            g["lr"] = lr
        try:
            return update(batch, spec, s, ref=ref, **kw)
        finally:
            for g, x in zip(groups, saved, strict=True):
                g["lr"] = x

    t.roles.actor.update = patched


@pytest.mark.slow
@pytest.mark.parametrize("action", ["raise_coef", "skip", "stop"])
def test_injected_kl_explosion(tmp_path, caplog, action):
    t = make(tmp_path, f"guard.on_max_kl={action}", "guard.max_kl=1.0")
    huge_lr_at(t, 2)
    m1, m2 = t.train_step(), t.train_step()
    assert m1["kl/ref_mean"] < 0.1 and m2["kl/ref_mean"] < 0.1  # the explosion is not visible before step 3's rollout
    assert "guard/kl_explosion" not in m1 and "guard/kl_explosion" not in m2
    before = params(t)
    if action == "stop":
        with pytest.raises(
            TrainingStopped,
            match=r"step 3: KL to the reference \d+\.\d+ nats/token > guard\.max_kl=1\.0 \(guard\.on_max_kl=stop\)",
        ):
            t.fit()
        assert same(before, params(t))
        last = lines(tmp_path)[-1]
        assert last["step"] == 3 and last["guard/stop"] == 1.0 and last["guard/kl_explosion"] == 1.0
        ckpt = tmp_path / "run" / "checkpoints" / "step_000003"
        assert json.loads((ckpt / "trainer_state.json").read_text())["stopped"] is True
        assert_finite(t)
        return
    m3 = t.train_step()
    assert m3["kl/ref_mean"] > 1.0 and m3["guard/kl_explosion"] == 1.0
    assert "guard/kl_explosion: step 3: KL to the reference" in caplog.text
    if action == "raise_coef":
        # the step's rewards were shaped with the old beta: kl/coef and reward/rlhf_mean use it, and the
        # doubled one is the next step's (issue 10 item 3: rlhf_mean was off by 2x here)
        assert m3["guard/coef_scale"] == 2.0 and m3["kl/coef"] == m2["kl/coef"] == m2["kl/coef_next"] == 0.05
        assert m3["kl/coef_next"] == pytest.approx(2 * m3["kl/coef"], rel=1e-12)
        rlhf = m3["reward/score_mean"] - m3["kl/coef"] * m3["kl/ref_seq_mean"]
        assert m3["reward/rlhf_mean"] == pytest.approx(rlhf, rel=1e-5, abs=1e-6)
        assert m3["policy/updates"] == 2.0 and not same(before, params(t))
    else:
        assert m3["guard/coef_scale"] == 1.0 and "policy/updates" not in m3 and same(before, params(t))
    t.train_step()
    assert t.step == 4
    assert_finite(t)


NAN_REWARD = '''
import math
from tether.tasks.digitsum import compute_score

CALLS = [0]

def reward(data_sources, solution_strs, ground_truths, extra_infos):
    """Call 2: every reward NaN; otherwise every 4th reward NaN."""
    CALLS[0] += 1
    out = [compute_score(s, g) for s, g in zip(solution_strs, ground_truths)]
    if CALLS[0] == 2:
        return [math.nan] * len(out)
    return [math.nan if i % 4 == 0 else v for i, v in enumerate(out)]
'''


@pytest.mark.slow
def test_nan_rewards_are_dropped_counted_and_never_reach_the_weights(tmp_path, caplog):
    fn = tmp_path / "nan_reward.py"
    fn.write_text(textwrap.dedent(NAN_REWARD))
    t = make(tmp_path, f"reward.function={fn}:reward", "trainer.total_steps=3")
    m1 = t.train_step()
    assert m1["reward/nonfinite_count"] == 4.0 and m1["guard/nonfinite_reward"] == 4.0
    assert m1["rollout/dropped_count"] >= 4.0 and m1["policy/updates"] == 2.0 and math.isfinite(m1["policy/pg_loss"])
    assert "guard/nonfinite_reward: step 1: 4 non-finite reward(s); those samples were dropped" in caplog.text
    before = params(t)
    m2 = t.train_step()  # every reward NaN: nothing left to learn from, the update is skipped
    assert m2["reward/all_invalid"] == 1.0 and m2["reward/nonfinite_count"] == 16.0 and m2["guard/empty_batch"] == 1.0
    assert "policy/updates" not in m2 and same(before, params(t))
    assert (
        "guard/empty_batch: step 2: every sample of the batch was dropped (reward/nonfinite_count=16, "
        "reward/invalid_count=16)" in caplog.text
    )
    m3 = t.train_step()
    assert m3["guard/nonfinite_reward"] == 4.0 and m3["policy/updates"] == 2.0 and not same(before, params(t))
    assert_finite(t)

    stop = make(tmp_path / "stop", f"reward.function={fn}:reward", "guard.on_nonfinite=stop")
    with pytest.raises(
        TrainingStopped, match=r"step 2: every sample of the batch was dropped.*guard\.on_nonfinite=stop"
    ):
        stop.fit()
    assert_finite(stop)


HANGING_REWARD = '''
import time
from tether.tasks.digitsum import compute_score

CALLS = [0]

def reward(data_sources, solution_strs, ground_truths, extra_infos):
    """Call 2 hangs forever; every other call scores normally."""
    CALLS[0] += 1
    if CALLS[0] >= 2:
        time.sleep(10**6)
    return [compute_score(s, g) for s, g in zip(solution_strs, ground_truths)]
'''


@pytest.mark.slow
def test_a_hung_reward_function_is_abandoned_and_the_run_stops_after_the_empty_batch_streak(tmp_path, caplog):
    fn = tmp_path / "hanging_reward.py"
    fn.write_text(textwrap.dedent(HANGING_REWARD))
    t = make(tmp_path, f"reward.function={fn}:reward", "reward.timeout_s=1", "trainer.total_steps=6")
    m1 = t.train_step()
    assert m1["reward/timeout_count"] == 0.0 and m1["policy/updates"] == 2.0
    before = params(t)
    m2 = t.train_step()  # hangs: abandoned after 1 s, all 16 samples are errors, no update
    assert m2["reward/timeout_count"] == 16.0 and m2["reward/error_count"] == 16.0 and m2["guard/empty_batch"] == 1.0
    assert "policy/updates" not in m2 and same(before, params(t))
    assert "did not return within reward.timeout_s=1 s: 16 of 16 sample(s) count as errors" in caplog.text
    t.train_step()
    with pytest.raises(
        TrainingStopped, match="every sample was dropped .*reward/error_count=16.* for 3 steps in a row"
    ):
        t.train_step()  # the consecutive-failure rule (reward.max_failed_steps, default 3)
    assert t.step == 4 and same(before, params(t))


@pytest.mark.slow
def test_nan_advantages_and_kl_are_never_applied(tmp_path, caplog):
    t = make(tmp_path, "actor.micro_batch_size=4", "trainer.total_steps=4")
    adv, logprobs = t.compute_advantages, t.compute_logprobs

    def nan_advantages(batch):
        adv(batch)
        if t.step == 2:
            batch.advantages[:] = math.nan  # every mini-batch
        if t.step == 3:
            batch.advantages[5, 0] = math.nan  # one response: its micro-batch of 4, so its whole mini-batch of 8

    def nan_kl(batch):
        logprobs(batch)
        if t.step == 4:
            batch.ref_logprobs[0, 0] = math.nan

    t.compute_advantages, t.compute_logprobs = nan_advantages, nan_kl
    t.train_step()
    before = params(t)
    m2 = t.train_step()
    assert m2["guard/nonfinite_skip"] == 2.0 and m2["policy/updates"] == 0.0 and same(before, params(t))
    assert (
        "guard/nonfinite_skip: step 2: a non-finite loss or gradient norm; 2 mini-batch update(s) not applied"
        in caplog.text
    )
    m3 = t.train_step()  # one of two mini-batches non-finite: guard.atomic_update undoes the other one's update too
    assert m3["guard/nonfinite_skip"] == 2.0 and m3["policy/updates"] == 0.0 and same(before, params(t))
    # the finite mini-batch was applied (before or after the skipped one), then undone
    assert m3["guard/undone_updates"] == 1.0
    before = params(t)
    m4 = t.train_step()
    assert m4["guard/nonfinite"] == 1.0 and "policy/updates" not in m4 and same(before, params(t))
    assert_finite(t)


@pytest.mark.slow
def test_target_kl_early_stop(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="tether")
    common = ["actor.lr=1e-3", "algo.ppo_epochs=2", "algo.mini_batch_size=4", "trainer.total_steps=1"]
    free = make(tmp_path / "free", *common, "guard.target_kl=null").train_step()
    assert free["policy/updates"] == 8.0 and free["guard/early_stop"] == 0.0  # 2 epochs x 4 mini-batches
    t = make(tmp_path, *common, "guard.target_kl=0.001")
    m = t.train_step()
    # the first mini-batch (approx KL 0) is applied; the second measures KL > target and stops everything
    assert m["guard/early_stop"] == 1.0 and m["policy/updates"] == 1.0 and t.roles.actor.scheduler.last_epoch == 1
    assert m["policy/approx_kl"] > 0.001 / 2  # mean of the two measured mini-batches: 0 and > target
    assert "guard/early_stop: step 1: policy/approx_kl > guard.target_kl=0.001" in caplog.text


@pytest.mark.slow
def test_rollback_restores_weights_raises_beta_lowers_lr_then_stops(tmp_path, caplog, capsys, monkeypatch):
    """A scripted validation drop, through the command line."""
    import tether.trainer.trainer as trainer_module  # the loop calls validate through its module
    from tether.cli import main

    scores = iter([0.5, 0.6, 0.3, 0.2])  # steps 0, 2, 4, 6
    monkeypatch.setattr(trainer_module, "validate", lambda *a, **k: {"val/score_mean": next(scores)})
    run = tmp_path / "run"
    args = [
        *BASE,
        f"trainer.output_dir={run}",
        "trainer.total_steps=8",
        "trainer.val_freq=2",
        "trainer.save_freq=2",
        "trainer.keep_last=2",
        "actor.lr=1e-3",
    ]
    args += [
        "guard.max_rollbacks=1",
        "guard.rollback_drop=0.05",
        "guard.coef_factor=3",
        "guard.rollback_lr_factor=0.25",
        "kl.coef=0.05",
        "guard.target_kl=null",
    ]
    assert main(["train", *args]) == 3
    err = capsys.readouterr().err
    assert "tether train: stopped by a guard: validation score 0.2000 at step 6" in err
    assert "already rolled back 1 time(s) (guard.max_rollbacks=1)" in err and "step_000002" in err
    assert (
        "guard/rollback: validation score 0.3000 at step 4" in caplog.text
        and "restored step 2 (rollback 1/1)" in caplog.text
    )

    recs = {r["step"]: r for r in lines(tmp_path)}
    assert sorted(recs) == [0, 1, 2, 3, 4, 5, 6]
    assert recs[4]["guard/rollback"] == 1.0 and recs[4]["guard/rollbacks"] == 1.0 and recs[4]["guard/coef_scale"] == 3.0
    assert recs[3]["kl/coef"] == 0.05 and recs[5]["kl/coef"] == pytest.approx(0.15, rel=1e-12)
    # rolled back after its update
    assert recs[4]["kl/coef"] == 0.05 and recs[4]["kl/coef_next"] == pytest.approx(0.15, rel=1e-12)
    assert recs[3]["actor/lr"] == 1e-3 and recs[5]["actor/lr"] == pytest.approx(2.5e-4, rel=1e-12)
    assert recs[6]["guard/stop"] == 1.0 and recs[6]["guard/rollback_limit"] == 1.0

    ck = run / "checkpoints"
    assert sorted(p.name for p in ck.iterdir()) == ["step_000002", "step_000004", "step_000006"]  # 2 is the stable one
    w2, w4 = (
        load_file(ck / "step_000002" / "actor" / "model.safetensors"),
        load_file(ck / "step_000004" / "actor" / "model.safetensors"),
    )
    assert w2.keys() == w4.keys() and all(torch.equal(w2[k], w4[k]) for k in w2)  # step 4 saved the restored weights
    o2, o4 = (torch.load(ck / f"step_00000{s}" / "optim.pt", weights_only=True) for s in (2, 4))
    for pid, st in o2["actor"]["state"].items():  # Adam moments restored too
        assert torch.equal(st["exp_avg"], o4["actor"]["state"][pid]["exp_avg"])
    assert o4["actor"]["param_groups"][0]["lr"] == pytest.approx(2.5e-4, rel=1e-12)
    assert o4["actor_sched"]["last_epoch"] == 8  # the schedule goes on: 4 steps x 2 mini-batches
    s4 = json.loads((ck / "step_000004" / "trainer_state.json").read_text())
    assert s4["guard"]["stable_step"] == 2 and s4["best"] == {"step": 2, "score": 0.6} and s4["val_score"] is None
    s6 = json.loads((ck / "step_000006" / "trainer_state.json").read_text())
    assert s6["stopped"] is True and s6["guard"]["rollbacks"] == 1


# --------------------------------------------------------------------------- noise-aware rollback


def _monitor(**kw):
    from tether.config import GuardConfig
    from tether.trainer.guards import GuardMonitor

    return GuardMonitor(GuardConfig(**kw))


def test_rollback_prefers_the_exact_score_and_its_zero_noise():
    g = _monitor()
    assert g.validation_score({"val/score_mean": 0.5, "val/score_sem": 0.04, "exact/score_mean": 0.61}) == (0.61, 0.0)
    assert g.validation_score({"val/score_mean": 0.5, "val/score_sem": 0.04}) == (0.5, 0.04)
    g2 = _monitor(rollback_metric="val/score_mean")
    assert g2.validation_score({"val/score_mean": 0.5, "val/score_sem": 0.04, "exact/score_mean": 0.61}) == (0.5, 0.04)


def test_a_drop_within_sampling_noise_is_not_a_rollback():
    g = _monitor(rollback_drop=0.05, rollback_z=2.0)
    g.val_step, g.val_sem = 100, 0.03
    g.mark_stable(100, 0.90)
    assert (g.stable_step, g.stable_score, g.stable_sem) == (100, 0.90, 0.03)
    # 5% of 0.90 is 0.045; 2 standard errors of the difference are 2·sqrt(0.03² + 0.03²) = 0.08485
    assert abs(g.floor(0.03) - (0.90 - 2 * (0.03**2 + 0.03**2) ** 0.5)) < 1e-12
    # without noise the 5% rule decides alone
    g.stable_sem = 0.0
    assert abs(g.floor(0.0) - 0.855) < 1e-12
    g_off = _monitor(rollback_drop=0.05, rollback_z=0.0)
    g_off.stable_score, g_off.stable_sem = 0.90, 0.03
    assert abs(g_off.floor(0.03) - 0.855) < 1e-12


def test_three_steps_without_a_valid_sample_stop_the_run(tmp_path):
    fn = tmp_path / "nan_reward.py"
    fn.write_text("def reward(ds, sols, gts, extras):\n    return [float('nan')] * len(sols)\n")
    t = make(tmp_path, f"reward.function={fn}:reward", "trainer.total_steps=6")
    with pytest.raises(
        TrainingStopped, match=r"step 3: every sample was dropped \(reward/nonfinite_count=16.*for 3 steps in a row"
    ):
        t.fit()
    assert t.step == 3
    assert_finite(t)
