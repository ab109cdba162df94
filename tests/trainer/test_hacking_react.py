"""Trainer.react: each new live finding is logged; a hacking one goes to the guard once a step; a resumed stop is not
re-applied."""

from types import SimpleNamespace

from tether.diagnostics import Finding
from tether.trainer.trainer import Trainer


def trainer_with(on_hacking: str, gold: bool = False):
    calls = []
    t = object.__new__(Trainer)
    t.cfg = SimpleNamespace(guard=SimpleNamespace(on_hacking=on_hacking))
    t.step, t.ckpt, t.roles, t.controller = 40, "ckpt", "roles", SimpleNamespace(value=0.0)
    t.guard = SimpleNamespace(
        on_hacking=lambda step, finding, ckpt, roles, beta: calls.append((step, finding.check, ckpt, roles, beta)),
        beta=lambda controller_beta: controller_beta,
    )
    t.diagnostics = SimpleNamespace(gold_seen=gold, forget_findings=lambda: calls.append("forget"))
    return t, calls


def trainer_whose_rollback_sets_the_floor(before: float, after: float):
    """A guard.on_hacking=rollback trainer (run with a gold) whose guard, on a hacking finding, restores a checkpoint
    and raises β's floor from ``before`` to ``after`` (β = max(controller's, floor))."""
    t, _ = trainer_with("rollback", gold=True)
    floor = {"v": before}

    def restore(step, finding, ckpt, roles, beta):
        t.guard.restores, floor["v"] = 1, after

    t.guard.restores, t.guard.on_hacking = 0, restore
    t.guard.beta = lambda controller_beta: max(controller_beta, floor["v"])
    return t


FOUND = [
    Finding("kl_rising", "kl/ref_mean", "m"),
    Finding("hacking_gold", "exact/gold_mean", "g"),
    Finding("hacking_proxy", "kl/ref_mean", "p"),
]


def test_both_hacking_checks_in_one_step_are_one_reaction(caplog):
    t, calls = trainer_with("rollback")
    t.react(FOUND)
    assert calls == [(40, "hacking_gold", "ckpt", "roles", 0.0)]
    assert sum("doctor:" in r.message for r in caplog.records) == 3  # every finding is still logged


def test_a_resumed_stop_is_not_applied_again_but_a_rollback_is():
    t, calls = trainer_with("stop")
    t.react(FOUND, log_them=False, resumed=True)
    assert calls == []
    t, calls = trainer_with("rollback")
    t.react(FOUND, log_them=False, resumed=True)
    assert [c[1] for c in calls] == ["hacking_gold"]


def test_with_a_gold_reward_a_proxy_warning_is_logged_not_acted_on(caplog):
    """The gold check sees a fall directly; hacking_proxy alone (a length drift while the gold holds, held-out
    short_any in docs/hacking.md) must not roll back or stop a run that measures the gold. Without a gold it does."""
    proxy = [Finding("hacking_proxy", "kl/ref_mean", "p")]
    t, calls = trainer_with("stop", gold=True)
    t.react(proxy)
    assert calls == [] and "acts on the gold check alone" in caplog.text
    t.react([Finding("hacking_gold", "val/gold_mean", "g"), *proxy])
    assert [c[1] for c in calls] == ["hacking_gold"]
    t, calls = trainer_with("stop", gold=False)
    t.react(proxy)
    assert [c[1] for c in calls] == ["hacking_proxy"]


def test_gold_seen_once_a_gold_mean_is_logged():
    from tether.diagnostics import LiveDiagnostics

    d = LiveDiagnostics()
    d.observe(0, {"reward/score_mean": 0.4})
    assert not d.gold_seen
    d.observe(0, {"val/gold_mean": 0.47})
    assert d.gold_seen


def test_a_restore_makes_the_live_diagnostics_forget_their_firing_findings():
    t, calls = trainer_with("rollback")
    t.guard.restores = 0
    t.react([])
    assert calls == []
    t.guard.restores = 1  # a rollback restored a checkpoint this step
    t.react([])
    t.react([])  # once per restore
    assert calls == ["forget"]


def test_a_rollback_replaces_the_doctors_advice_in_its_line(caplog):
    """The new-user trial: the guard set β to its floor 0.05 while the doctor's line of the same step advised 'set
    kl.coef=0.05'. Under rollback the guard acts first; a line whose finding it acted on says so, and one it could not
    act on (no checkpoint to restore, β unchanged) keeps the advice."""
    gold = [Finding("hacking_gold", "val/gold_mean", "g", suggestion="set kl.coef=0.05 (now 0)")]
    t = trainer_whose_rollback_sets_the_floor(0.0, 0.05)
    t.react(gold)
    (line,) = [r.getMessage() for r in caplog.records if "doctor:" in r.getMessage()]
    assert "guard.on_hacking=rollback acted on it (β now 0.05)" in line and "set kl.coef" not in line
    caplog.clear()
    t.guard.on_hacking = lambda *a: None  # no stable checkpoint yet: the guard only warns
    t.react(gold)
    (line,) = [r.getMessage() for r in caplog.records if "doctor:" in r.getMessage()]
    assert "suggestion: set kl.coef=0.05" in line


def test_a_rollback_supersedes_the_other_advice_of_its_step(caplog):
    """A user trying docs/hacking.md's box saw, in the step a rollback set β to 0.1, a kl_rising line (logged before
    the guard's) and a hacking_kl_focus line (after it) each advising 'raise kl.coef (now 0.05) to 0.1': advice written
    before the restore. Under rollback the guard acts before any line of the step; the line it acted on says so and
    every other line of the step says the rollback superseded its advice, in the order the doctor found them."""
    found = [
        Finding("kl_rising", "kl/ref_mean", "k", suggestion="raise kl.coef (now 0.05) to 0.1"),
        Finding("hacking_gold", "val/gold_mean", "g", suggestion="raise kl.coef (now 0.05) to 0.1"),
        Finding("hacking_kl_focus", "kl/token_top_share", "f", suggestion="raise kl.coef (now 0.05) to 0.1"),
    ]
    t = trainer_whose_rollback_sets_the_floor(0.05, 0.1)
    t.react(found)
    lines = [r.getMessage() for r in caplog.records if "doctor:" in r.getMessage()]
    assert [ln.split(";")[0] for ln in lines] == ["doctor: k", "doctor: g", "doctor: f"]
    assert "guard.on_hacking=rollback acted on it (β now 0.1)" in lines[1]
    for ln in (lines[0], lines[2]):
        assert "superseded: guard.on_hacking=rollback restored an earlier checkpoint this step (β now 0.1)" in ln
        assert "raise kl.coef" not in ln
    caplog.clear()
    t.guard.on_hacking = lambda *a: None  # no stable checkpoint: nothing superseded, every advice kept
    t.react(found)
    lines = [r.getMessage() for r in caplog.records if "doctor:" in r.getMessage()]
    assert all("suggestion: raise kl.coef (now 0.05) to 0.1" in ln for ln in lines)


def test_the_guard_does_not_act_on_an_info_finding(caplog):
    """hacking_gold's info finding (a gold below 0, not judged) is logged, never rolled back or stopped on."""
    info = [Finding("hacking_gold", "val/gold_mean", "the gold check cannot judge", severity="info")]
    for mode in ("rollback", "stop"):
        t, calls = trainer_with(mode, gold=True)
        t.react(info)
        assert calls == [] and "doctor: the gold check cannot judge" in caplog.text
