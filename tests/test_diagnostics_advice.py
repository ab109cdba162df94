"""Every suggestion of the doctor is valid for the run's own settings (issue 33): under each policy loss and each
setting that refuses keys, each finding's overrides load through the real config loader on top of the run's config,
and its text names no config key that is not in them (with algo.policy_loss=gspo the live clipfrac_high used to
suggest widening algo.clip_eps_high, which gspo refuses)."""

import re

import pytest

from tether.config import TetherConfig, _known_keys, load_config
from tether.diagnostics import CHECKS, diagnose

POLICY_LOSSES = TetherConfig.model_fields["algo"].annotation.model_fields["policy_loss"].annotation.__args__
# settings that refuse or constrain the keys the doctor suggests
OTHER_MODES = [
    ["algo.ppo_epochs=2"],
    ["rollout.async_steps=1"],  # refuses algo.filter_groups
    ["algo.filter_groups=true"],
    ["algo.entropy_target=0.5"],  # refuses algo.entropy_coef above algo.entropy_coef_max
    ["trainer.save_freq=0"],  # refuses guard.on_hacking=rollback
    ["trainer.save_freq=500", "trainer.total_steps=20"],  # so does a save_freq past the run's end
    ["trainer.val_freq=0"],  # and no validation
    ["guard.on_hacking=rollback", "trainer.save_freq=10"],
    ["kl.controller=adaptive"],
    ["kl.controller=band"],  # kl.high must stay above kl.low
    ["kl.controller=exponential"],
    ["kl.controller=scheduled"],
    ["kl.beta_max=0.2"],
    ["kl.placement=none"],
    ["kl.coef=0"],
    ["kl.placement=none", "kl.coef=0"],
    ["actor.old_logprobs_source=rollout", "rollout.do_sample=false"],  # refuses rollout.temperature != 1
]
MODES = [[f"algo.policy_loss={m}"] for m in POLICY_LOSSES] + OTHER_MODES
KEYS = set(_known_keys(TetherConfig))
NEEDS_USER_INPUT = {"reward.val_function"}  # a file the user writes


def sick_histories(coef: float) -> list[list[dict]]:
    """Histories on which, together, every check fires (the first one most of them; the second with β rising, the
    third a falling gold, the fourth an accelerating KL that sits on one token id)."""
    drift = [
        {
            "step": s,
            "kl/ref_mean": 0.002 * s,
            "kl/coef": coef,
            "reward/score_mean": 0.5 if s % 2 else 0.4,
            "policy/entropy": 1.5 if s <= 5 else 0.5,
            "response/length_mean": 100.0 if s <= 5 else 50.0,
            "policy/clipfrac": 0.5,
            "diversity/collapse_rate": 0.0 if s <= 5 else 0.5,
            "rollout/zero_var_group_frac": 0.95,
        }
        for s in range(1, 61)
    ]
    pushing = [{"step": s, "kl/ref_mean": 0.002 * s, "kl/coef": 0.05 * (1 + s / 10)} for s in range(1, 61)]
    gold = [
        {"step": s, "exact/gold_mean": g, "exact/score_mean": p, "kl/coef": coef}
        for s, g, p in ((10, 0.6, 0.5), (20, 0.7, 0.6), (30, 0.3, 0.8))
    ]
    accel = [
        {
            "step": s,
            "kl/ref_mean": 0.001 * s if s <= 30 else 0.03 + 0.02 * (s - 30),
            "kl/coef": coef,
            "response/length_mean": 100.0 if s <= 20 else 60.0,
            "reward/score_mean": 0.01 * s,
            "kl/token_top_share": 0.2 if s <= 20 else 0.6,  # the KL sits on one token id (hacking_kl_focus)
        }
        for s in range(1, 41)
    ]
    return [drift, pushing, gold, accel]


def named_keys(text: str) -> set[str]:
    return {k for k in re.findall(r"[a-z_0-9]+(?:\.[a-z_0-9]+)+", text) if k in KEYS}


@pytest.mark.parametrize("mode", MODES, ids=[" ".join(m) for m in MODES])
def test_every_suggestion_loads_on_the_runs_own_config(mode):
    cfg = load_config(None, mode)
    tree = cfg.to_dict()
    findings = [f for h in sick_histories(cfg.kl.coef) for f in diagnose(h, config=tree)]
    assert {f.check for f in findings} == set(CHECKS), "a check did not fire: the test would check nothing of it"
    loaded = 0
    for f in findings:
        for alt in f.overrides:
            loaded += 1
            load_config(None, [*mode, *(f"{k}={v}" for k, v in alt.items())])  # raises ConfigError if refused
        offered = {k for alt in f.overrides for k in alt}
        assert named_keys(f.suggestion) - NEEDS_USER_INPUT <= offered, (f.check, f.suggestion, f.overrides)
    assert loaded >= len(CHECKS)  # a finding without overrides names no key (checked above); most have several


def test_gspo_clipfrac_names_no_refused_clip_key():
    cfg = load_config(None, ["algo.policy_loss=gspo"])
    [f] = [f for f in diagnose(sick_histories(0.05)[0], config=cfg.to_dict()) if f.check == "clipfrac_high"]
    assert "algo.clip_eps_high" not in f.suggestion and f.overrides == ({"actor.lr": cfg.actor.lr / 2},)
    assert f.suggestion.startswith(f"lower actor.lr (now {cfg.actor.lr:.4g}); widening the policy loss's clip range")
