"""actor.old_logprobs_source=rollout: the rollout engine's sampled-token log-probs serve as
old_logprobs (the HF engine here; the real vLLM engine in tests/vllm)."""

import math

import pytest
import torch

from tether.config import ConfigError, load_config
from tether.trainer import Trainer

ROLLOUT = [
    "actor.old_logprobs_source=rollout",
    "rollout.temperature=0.8",
    "trainer.val_freq=0",
    "trainer.save_freq=0",
    "trainer.report=false",
]


def test_rollout_logprobs_replace_the_actors_pass(small_cfg, tmp_path):
    t = Trainer(small_cfg(*ROLLOUT, out=tmp_path / "r"))
    calls = []
    orig = t.roles.actor.compute_logprobs
    t.roles.actor.compute_logprobs = lambda *a, **k: calls.append(1) or orig(*a, **k)
    batch = t.rollout()
    t.score(batch)
    t.compute_logprobs(batch)
    assert calls == []  # no actor pass
    m = batch.response_mask.bool()
    assert torch.equal(batch.old_logprobs[m], batch.rollout_logprobs[m].float()) and (batch.old_logprobs[~m] == 0).all()
    assert batch.entropy is None and batch.extra["old_logprobs_metrics"] == {"rollout/old_logprobs_from_rollout": 1.0}
    recomputed, _, _, _ = orig(batch, with_entropy=False)
    diff = (recomputed - batch.old_logprobs)[m].abs()
    assert float(diff.max()) < 5e-5  # HF generate's KV-cache passes against the full forward, float32
    assert float(batch.old_logprobs[m].min()) < -0.5  # sampled at temperature 0.8: real uncertainty


def test_a_missing_rollout_logprob_falls_back_to_recompute(small_cfg, tmp_path):
    t = Trainer(small_cfg(*ROLLOUT, out=tmp_path / "r"))
    batch = t.rollout()
    t.score(batch)
    batch.rollout_logprobs[0, 0] = math.nan  # e.g. an EOS an old vLLM dropped
    t.compute_logprobs(batch)
    assert batch.extra["old_logprobs_metrics"] == {"rollout/old_logprobs_from_rollout": 0.0}
    assert batch.entropy is not None and torch.isfinite(batch.old_logprobs).all()


@pytest.mark.slow
def test_training_with_rollout_logprobs_logs_the_mismatch(small_cfg, tmp_path):
    # one mini-batch
    t = Trainer(small_cfg(*ROLLOUT, "trainer.total_steps=2", "algo.mini_batch_size=16", out=tmp_path / "r"))
    hist = t.fit()
    for h in hist:
        assert h["rollout/old_logprobs_from_rollout"] == 1.0
        # old_logprobs are the engine's: no independent measurement
        assert not any(k.startswith("rollout/logprob_diff") for k in h)
        assert math.isnan(h["policy/entropy"]) and math.isfinite(h["policy/loss"]) and math.isfinite(h["kl/ref_mean"])
    # the first update's π_old is the rollout policy as generate computed it: the ratio is 1 up to the
    # engine-trainer mismatch, which approx_kl (mean log π_old − log π_θ) and clipfrac now measure
    print("HF engine, old_logprobs_source=rollout: step-1 policy/approx_kl", hist[0]["policy/approx_kl"])
    assert abs(hist[0]["policy/approx_kl"]) < 1e-6 and hist[0]["policy/clipfrac"] == 0.0
    # step 2: the moved policy, sampled and scored alike
    assert abs(hist[1]["policy/approx_kl"]) < 1e-6 and hist[1]["kl/ref_mean"] > 0


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["kl.estimator=full"], "kl.estimator=full needs the actor's logits"),
        (["rollout.mode=offline", "data.response_key=response"], "rollout.mode=offline has no rollout engine"),
    ],
)
def test_rollout_logprobs_refused_where_there_are_none(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["actor.old_logprobs_source=rollout", *overrides])


def test_old_logprobs_source_default_is_recompute():
    assert load_config(None, []).actor.old_logprobs_source == "recompute"


def test_greedy_rollout_logprobs_with_a_temperature_are_refused():
    """Greedy decoding's recorded log-probs are untempered (vLLM gives no others), while the trainer's
    ratio and KL use rollout.temperature: a silent KL of -0.13 at step 1 in a new-user trial."""
    with pytest.raises(
        ConfigError, match=r"actor.old_logprobs_source=rollout with rollout.do_sample=false: .*rollout.temperature=0.7"
    ):
        load_config(None, ["actor.old_logprobs_source=rollout", "rollout.do_sample=false", "rollout.temperature=0.7"])
    for ok in (["rollout.do_sample=false", "rollout.temperature=1.0"], ["rollout.temperature=0.7"]):
        assert load_config(None, ["actor.old_logprobs_source=rollout", *ok]).actor.old_logprobs_source == "rollout"
