"""tether.algos.controllers: trajectories by hand, bounds, validation, exact resume."""

import json
import math

import pytest

from tether.algos import (
    KL_CONTROLLERS,
    AdaptiveKLController,
    BandKLController,
    ExponentialKLController,
    FixedKLController,
    ScheduledKLController,
    make_kl_controller,
)


def _run(ctrl, kls, n_steps=1):
    return [ctrl.update(kl, n_steps) for kl in kls]


def test_fixed_never_moves():
    c = FixedKLController(0.05)
    assert _run(c, [0.0, 10.0, 0.5]) == [0.05, 0.05, 0.05]
    assert c.value == 0.05 and c.n_updates == 3
    assert FixedKLController(0.0).update(1.0) == 0.0  # beta = 0 (no KL penalty) is allowed here


def test_adaptive_trajectory_by_hand():
    # target 0.1 nats/token, horizon 100 responses, 10 responses per batch:
    # KL 0.15 -> e = +0.5 clipped to +0.2 -> x(1 + 0.2 * 10/100) = x1.02
    # KL 0.05 -> e = -0.5 clipped to -0.2 -> x0.98
    # KL 0.11 -> e = +0.1 -> x1.01 ;  KL 0.1 -> e = 0 -> x1
    c = AdaptiveKLController(0.1, target=0.1, horizon=100)
    got = _run(c, [0.15, 0.05, 0.11, 0.1], n_steps=10)
    expected = [0.102, 0.102 * 0.98, 0.102 * 0.98 * 1.01, 0.102 * 0.98 * 1.01]
    assert got == pytest.approx(expected, rel=1e-12)
    assert expected[1] == pytest.approx(0.09996, abs=1e-15) and expected[2] == pytest.approx(0.1009596, abs=1e-15)


def test_adaptive_defaults_follow_ziegler_and_n_steps_counts_responses():
    c = AdaptiveKLController(0.2)
    assert (c.target, c.horizon, c.clip) == (0.1, 10000, 0.2)
    # 256 responses at twice the target: beta grows by 0.2 * 256 / 10000
    assert c.update(0.2, n_steps=256) == pytest.approx(0.2 * (1 + 0.2 * 256 / 10000), rel=1e-12)
    assert c.update(0.2, n_steps=0) == pytest.approx(0.2 * (1 + 0.2 * 256 / 10000), rel=1e-12)
    with pytest.raises(ValueError, match="horizon"):
        AdaptiveKLController(0.2, horizon=100).update(0.0, n_steps=500)  # multiplier would be <= 0


def test_band_trajectory_by_hand():
    c = BandKLController(1.0)  # high 0.1, low 0.01, up 1.2, down 0.8
    got = _run(c, [0.2, 0.05, 0.005, 0.1, 0.01, 0.5], n_steps=999)  # n_steps is ignored
    assert got == pytest.approx([1.2, 1.2, 0.96, 0.96, 0.96, 1.152], rel=1e-12)


def test_exponential_trajectory_by_hand():
    c = ExponentialKLController(1.0, target=0.1, lr=0.5)
    got = _run(c, [0.2, 0.05, 0.1])  # log-steps +0.5, -0.25, 0
    assert got == pytest.approx([math.exp(0.5), math.exp(0.25), math.exp(0.25)], rel=1e-12)
    capped = ExponentialKLController(1.0, target=0.1, lr=0.5, max_log_step=0.1)
    assert capped.update(100.0) == pytest.approx(math.exp(0.1), rel=1e-12)
    huge = ExponentialKLController(1.0, target=1e-6, lr=1.0)
    assert math.isfinite(huge.update(1e9))  # log-beta capped: never inf


def test_scheduled_piecewise_counts_update_calls_not_responses():
    c = ScheduledKLController(0.08, "piecewise", stages=[[2, 0.08], [3, 0.03], [1, 0.01]])
    values = [c.value] + [c.update(0.1, n_steps=256) for _ in range(8)]
    assert values == [0.08, 0.08, 0.03, 0.03, 0.03, 0.01, 0.01, 0.01, 0.01]  # last stage holds forever
    assert c.n_updates == 8
    # the stages alone define beta (coef is not used by this kind); a last stage of length 0 is fine
    d = ScheduledKLController(0.05, "piecewise", stages=[[50, 0.08], [0, 0.03]])
    assert d.value == 0.08 and [d.update(0.0) for _ in range(51)][-2:] == [0.03, 0.03]


def test_scheduled_linear_and_cosine_by_hand():
    lin = ScheduledKLController(1.0, "linear", final_coef=0.0, total_steps=4)
    assert [lin.value] + _run(lin, [0.0] * 5) == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0, 0.0], abs=1e-15)
    cos = ScheduledKLController(1.0, "cosine", final_coef=0.2, total_steps=4)
    # 0.2 + 0.8 * ½(1 + cos(pi k / 4))
    expected = [1.0, 0.2 + 0.4 * (1 + math.sqrt(0.5)), 0.6, 0.2 + 0.4 * (1 - math.sqrt(0.5)), 0.2, 0.2]
    assert [cos.value] + _run(cos, [0.0] * 5) == pytest.approx(expected, abs=1e-15)


def test_bounds_clamp_beta():
    c = AdaptiveKLController(0.1, target=0.1, horizon=10, beta_max=0.104)
    assert _run(c, [1.0, 1.0, 1.0], n_steps=1) == pytest.approx([0.102, 0.104, 0.104], rel=1e-12)  # 0.10404 capped
    b = BandKLController(1.0, beta_min=0.7)
    assert _run(b, [0.0, 0.0, 0.0]) == pytest.approx([0.8, 0.7, 0.7], rel=1e-12)
    s = ScheduledKLController(1.0, "linear", final_coef=0.0, total_steps=2, beta_min=0.3)
    assert _run(s, [0.0, 0.0]) == pytest.approx([0.5, 0.3], rel=1e-12)
    p = ScheduledKLController(0.0, stages=[[1, 0.5], [1, 0.01]], beta_max=0.2, beta_min=0.02)
    assert [p.value] + _run(p, [0.0]) == [0.2, 0.02]  # the schedule is clamped, not rejected


def _controllers():
    return [
        lambda: FixedKLController(0.1),
        lambda: AdaptiveKLController(0.1, target=0.05, horizon=1000),
        lambda: BandKLController(0.1, beta_max=0.3),
        lambda: ExponentialKLController(0.1, target=0.05, lr=0.3),
        lambda: ScheduledKLController(0.1, "cosine", final_coef=0.01, total_steps=5),
        lambda: ScheduledKLController(0.1, stages=[[2, 0.1], [2, 0.05]]),
    ]


@pytest.mark.parametrize("make", _controllers())
def test_state_dict_round_trip_resumes_exactly(make):
    kls = [0.3, 0.01, 0.07, 0.2, 0.001, 0.05, 0.12, 0.09]
    straight = make()
    full = _run(straight, kls, n_steps=64)
    first = make()
    _run(first, kls[:3], n_steps=64)
    state = json.loads(json.dumps(first.state_dict()))
    resumed = make()
    resumed.load_state_dict(state)
    assert resumed.value == first.value and resumed.n_updates == 3
    assert _run(resumed, kls[3:], n_steps=64) == full[3:]  # exact equality, not approx


def test_load_state_dict_rejects_another_controller():
    with pytest.raises(ValueError, match="adaptive"):
        BandKLController(0.1).load_state_dict(AdaptiveKLController(0.1).state_dict())


@pytest.mark.parametrize(
    "factory,arg",
    [
        (lambda: AdaptiveKLController(0.1, target=0.0), "target"),
        (lambda: AdaptiveKLController(0.1, target=-1.0), "target"),
        (lambda: AdaptiveKLController(0.1, horizon=0), "horizon"),
        (lambda: AdaptiveKLController(0.0), "coef"),
        (lambda: FixedKLController(-0.1), "coef"),
        (lambda: FixedKLController(math.nan), "coef"),
        (lambda: BandKLController(0.1, up=1.0), "up"),
        (lambda: BandKLController(0.1, down=1.0), "down"),
        (lambda: BandKLController(0.1, down=0.0), "down"),
        (lambda: BandKLController(0.1, low=0.2, high=0.1), "low"),
        (lambda: ExponentialKLController(0.1, lr=0.0), "lr"),
        (lambda: ExponentialKLController(0.1, target=0.0), "target"),
        (lambda: FixedKLController(0.1, beta_min=0.2, beta_max=0.1), "beta_min"),
        (lambda: FixedKLController(0.1, beta_min=-1.0), "beta_min"),
        (lambda: FixedKLController(0.5, beta_max=0.1), "coef"),
        (lambda: ScheduledKLController(0.1, "step"), "kind"),
        (lambda: ScheduledKLController(0.1, "piecewise"), "stages"),
        (lambda: ScheduledKLController(0.1, stages=[[0, 0.1], [1, 0.2]]), "num_steps"),
        (lambda: ScheduledKLController(0.1, stages=[[1, 0.1], [-1, 0.2]]), "num_steps"),
        (lambda: ScheduledKLController(0.1, stages=[[2, -0.1]]), "beta"),
        (lambda: ScheduledKLController(-0.2, stages=[[2, 0.1]]), "coef"),
        (lambda: ScheduledKLController(0.1, "linear", total_steps=3), "final_coef"),
        (lambda: ScheduledKLController(0.1, "linear", final_coef=-0.1, total_steps=3), "final_coef"),
        (lambda: ScheduledKLController(0.1, "cosine", final_coef=0.0, total_steps=0), "total_steps"),
        (lambda: FixedKLController(0.1).update(math.nan), "current_kl"),
        (lambda: AdaptiveKLController(0.1).update(math.inf, 4), "current_kl"),
        (lambda: ScheduledKLController(0.1, stages=[[1, 0.1]]).update(-math.inf), "current_kl"),
        (lambda: BandKLController(0.1).update(0.1, n_steps=-1), "n_steps"),
    ],
)
def test_invalid_arguments_raise_value_error_naming_them(factory, arg):
    with pytest.raises(ValueError, match=arg):
        factory()


def test_factory():
    assert KL_CONTROLLERS == ("fixed", "adaptive", "band", "exponential", "scheduled")
    assert isinstance(make_kl_controller("adaptive", 0.1, target=0.2, horizon=500), AdaptiveKLController)
    s = make_kl_controller("scheduled", 0.08, kind="piecewise", stages=[[1, 0.08], [1, 0.03]])
    assert s.update(0.0, 128) == 0.03
    for name in KL_CONTROLLERS:
        kwargs = {"kind": "linear", "final_coef": 0.0, "total_steps": 2} if name == "scheduled" else {}
        ctrl = make_kl_controller(name, 0.1, **kwargs)
        assert ctrl.name == name and ctrl.value == 0.1
    with pytest.raises(ValueError, match="fixed, adaptive, band, exponential, scheduled"):
        make_kl_controller("pid", 0.1)
    with pytest.raises(ValueError, match="horizn"):
        make_kl_controller("adaptive", 0.1, horizn=5)
