"""algo.policy_loss in the trainer: every mode runs on the embedded task with finite metrics, the config refuses a
mode's settings under another mode, and loss_agg_mode null takes the mode's own aggregation."""

import json
import math

import pytest

from tether.algos import POLICY_LOSSES
from tether.config import ConfigError, load_config
from tether.trainer import Trainer

QUIET = ["trainer.val_freq=0", "trainer.save_freq=0", "trainer.report=false", "trainer.total_steps=2"]
OWN = {
    "gspo": "policy/seq_ratio_abs_dev",
    "gspo_token": "policy/seq_ratio_abs_dev",
    "gmpo": "policy/seq_ratio_abs_dev",
    "clip_cov": "policy/cov_selected_frac",
    "kl_cov": "policy/cov_selected_frac",
}


@pytest.mark.parametrize("name", POLICY_LOSSES)
def test_two_steps_of_every_mode_end_finite(small_cfg, tmp_path, name):
    """Two mini-batches a step (the second off-policy), so each mode's ratio moves off 1."""
    Trainer(small_cfg(*QUIET, f"algo.policy_loss={name}", out=tmp_path / "r")).fit()
    rows = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines() if '"step": 0' not in x]
    assert len(rows) == 2
    for r in rows:
        bad = [k for k, v in r.items() if isinstance(v, float) and not math.isfinite(v)]
        assert not bad, bad
        assert r["policy/updates"] == 2.0 and r["policy/grad_norm"] > 0
        assert OWN.get(name, "policy/clipfrac") in r


def test_config_lists_refuses_and_resolves(tmp_path):
    cfg = load_config(None, ["algo.policy_loss=gspo"])
    assert cfg.algo.agg_mode == "seq-mean-token-mean" and cfg.algo.policy_loss_hyper() == {
        "clip_eps_low": 3e-4,
        "clip_eps_high": 4e-4,
    }
    assert load_config(None, ["algo.policy_loss=gspo", "algo.loss_agg_mode=token-mean"]).algo.agg_mode == "token-mean"
    assert load_config(None, []).algo.agg_mode == "token-mean"
    assert load_config(None, ["algo.policy_loss=dppo_kl"]).algo.policy_loss_hyper() == {
        "delta_low": 0.05,
        "delta_high": 0.05,
        "is_cap": 20.0,
    }
    assert load_config(None, ["algo.policy_loss=cispo"]).algo.policy_loss_hyper() == {
        "clip_eps_low": None,
        "clip_eps_high": 0.2,
    }
    with pytest.raises(
        ConfigError, match=r"algo.sapo.tau_neg=2.0 has no effect with algo.policy_loss=vanilla \(read by sapo\)"
    ):
        load_config(None, ["algo.sapo.tau_neg=2.0"])
    with pytest.raises(
        ConfigError, match=r"algo.clip_eps_high=0.28 has no effect with algo.policy_loss=gspo .*algo.gspo"
    ):
        load_config(None, ["algo.policy_loss=gspo", "algo.clip_eps_high=0.28"])
    with pytest.raises(ConfigError, match="clip_cov.lb"):
        load_config(None, ["algo.policy_loss=clip_cov", "algo.clip_cov.lb=6"])
    with pytest.raises(ConfigError, match="policy_loss"):
        load_config(None, ["algo.policy_loss=ppo"])
    assert (
        load_config(None, ["algo.policy_loss=clip_cov", "algo.clip_eps_high=0.28"]).algo.policy_loss_hyper()[
            "clip_eps_high"
        ]
        == 0.28
    )


def test_help_config_lists_every_mode(capsys):
    from tether.cli import main

    try:
        rc = main(["train", "--help-config"])
    except SystemExit as e:
        rc = e.code
    assert rc in (0, None)
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if "algo.policy_loss" in x)
    for name in POLICY_LOSSES:
        assert name in out
    assert "gspo" in line or "vanilla" in line
    for key in (
        "algo.gspo.clip_eps_low",
        "algo.sapo.tau_neg",
        "algo.dppo_kl.delta_high",
        "algo.kl_cov.coef",
        "algo.clip_cov.ub",
    ):
        assert key in out
