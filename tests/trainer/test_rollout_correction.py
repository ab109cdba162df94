"""algo.rollout_correction and kl.off_policy_correction in the trainer and the actor (HF engine here; the real
vLLM engine in tests/vllm)."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from tether.config import ConfigError, load_config
from tether.tasks.sft import default_reference_path
from tether.trainer import Trainer
from tether.workers import ActorWorker
from tether.workers.actor import ActorUpdateSpec

QUIET = ["trainer.val_freq=0", "trainer.save_freq=0", "trainer.report=false", "trainer.total_steps=2"]
MISMATCH = ["rollout.engine_temperature=1.5"]  # the engine samples at 1.5, the trainer's log-probs are at 1.0


def metrics(run) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def test_token_truncation_weights_the_batch_and_logs_rollout_corr(small_cfg, tmp_path):
    t = Trainer(small_cfg(*QUIET, *MISMATCH, "algo.rollout_correction.level=token", out=tmp_path / "r"))
    batch = t.rollout()
    t.score(batch)
    t.compute_logprobs(batch)
    assert batch.rollout_logprobs is not None  # the HF engine returns its own log-probs when a correction is on
    t.correct_rollout(batch)
    m = batch.response_mask.bool()
    ratio = torch.exp(batch.old_logprobs - batch.rollout_logprobs.float())
    assert torch.allclose(batch.is_weights[m], ratio[m].clamp(max=2.0), rtol=1e-6, atol=0)
    assert (batch.is_weights[~m] == 0).all() and torch.equal(batch.loss_mask, m)
    mm = batch.extra["rollout_corr_metrics"]
    # T = 1.5 against 1.0: a real gap (k1 is too noisy on 16 responses to assert)
    assert mm["rollout_corr/k3_kl"] > 0.01, mm
    assert 0 < mm["rollout_corr/ess"] < 1
    assert mm["rollout_corr/weight_p05"] <= mm["rollout_corr/weight_p50"] <= mm["rollout_corr/weight_p95"]

    t.fit()
    lines = [r for r in metrics(tmp_path / "r") if r["step"] > 0]
    assert len(lines) == 2
    for r in lines:
        assert 0 < r["rollout_corr/ess"] <= 1 and r["rollout_corr/k3_kl"] > 0 and "timing/rollout_correction_s" in r


def test_no_correction_no_weights_and_no_engine_logprobs(small_cfg, tmp_path):
    t = Trainer(small_cfg(*QUIET, out=tmp_path / "r"))
    assert not t.roles.engine.params.logprobs  # nothing asks for them: no cost
    batch = t.rollout()
    t.score(batch)
    t.compute_logprobs(batch)
    t.correct_rollout(batch)
    assert batch.is_weights is None and "rollout_corr_metrics" not in batch.extra
    assert torch.equal(batch.loss_mask, batch.generated_mask.bool())  # the generated tokens, nothing rejected


def test_rejection_takes_whole_responses_out_of_the_update(small_cfg, tmp_path):
    t = Trainer(
        small_cfg(
            *QUIET,
            *MISMATCH,
            "algo.rollout_correction.reject=seq_mean_k3",
            "algo.rollout_correction.reject_threshold=0.02",
            out=tmp_path / "r",
        )
    )
    batch = t.rollout()
    t.score(batch)
    t.compute_logprobs(batch)
    t.correct_rollout(batch)
    rejected = batch.response_mask.bool().any(-1) & ~batch.loss_mask.any(-1)
    assert 0 < int(rejected.sum()) < len(batch)
    assert batch.extra["rollout_corr_metrics"]["rollout_corr/rejected_seq_frac"] == pytest.approx(
        float(rejected.sum()) / len(batch)
    )
    assert torch.equal(batch.update_mask.bool(), batch.loss_mask)


def _actor(seed: int = 0) -> ActorWorker:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(default_reference_path(), dtype=torch.float32)
    return ActorWorker(
        model,
        lr=1e-2,
        weight_decay=0.0,
        betas=(0.9, 0.999),
        warmup_steps=0,
        grad_clip=1e9,
        micro_batch_size=3,
        temperature=1.0,
    )


def _spec(**kw) -> ActorUpdateSpec:
    base = dict(
        ppo_epochs=1,
        mini_batch_size=64,
        clip_eps_low=0.2,
        clip_eps_high=0.2,
        dual_clip_c=3.0,
        loss_agg_mode="token-mean",
        entropy_coef=0.0,
        kl_loss_coef=0.1,
        kl_loss_estimator="k3",
        kl_loss_agg_mode="token-mean",
        log_ratio_clamp=20.0,
        value_clamp=10.0,
        target_kl=None,
        seed=0,
        norm_constant=4.0,
    )
    return ActorUpdateSpec(**(base | kw))


def _prepared_batch(small_cfg, tmp_path):
    t = Trainer(small_cfg(*QUIET, out=tmp_path / "b"))
    batch = t.rollout()
    t.score(batch)
    t.compute_logprobs(batch)
    t.apply_kl(batch)
    t.compute_advantages(batch)
    batch.old_logprobs = batch.old_logprobs + 0.05 * torch.randn(
        batch.old_logprobs.shape, generator=torch.Generator().manual_seed(1)
    )
    return batch


def _weights_after(actor: ActorWorker) -> list[torch.Tensor]:
    return [p.detach().clone() for p in actor.model.parameters()]


def test_a_rejected_response_is_the_same_as_a_dropped_one(small_cfg, tmp_path):
    """loss_mask (rejection) leaves a response out of the loss and of its token counts, exactly like dropping it."""
    batch = _prepared_batch(small_cfg, tmp_path)
    reject = torch.zeros(len(batch), dtype=torch.bool)
    reject[[1, 5, 6]] = True
    rejected = batch.select(list(range(len(batch))))
    rejected.loss_mask = batch.response_mask.bool() & ~reject[:, None]
    dropped = batch.select(list(range(len(batch))))
    dropped.drop(reject)
    out = {}
    for name, b in (("rejected", rejected), ("dropped", dropped)):
        actor = _actor()
        out[name] = (actor.update(b, _spec(), step=1), _weights_after(actor))
    assert out["rejected"][0]["policy/loss"] == pytest.approx(out["dropped"][0]["policy/loss"], rel=1e-6)
    for a, b in zip(out["rejected"][1], out["dropped"][1], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)


def test_unit_weights_change_nothing_and_weights_scale_the_loss(small_cfg, tmp_path):
    batch = _prepared_batch(small_cfg, tmp_path)
    plain = _actor().update(batch, _spec(), step=1)
    ones = batch.select(list(range(len(batch))))
    ones.is_weights = torch.ones_like(batch.old_logprobs)
    assert _actor().update(ones, _spec(), step=1)["policy/loss"] == plain["policy/loss"]
    half = batch.select(list(range(len(batch))))
    half.is_weights = torch.full_like(batch.old_logprobs, 0.5)
    assert _actor().update(half, _spec(), step=1)["policy/loss"] == pytest.approx(0.5 * plain["policy/loss"], rel=1e-6)


def test_kl_off_policy_correction_changes_the_off_policy_kl_loss_only_through_the_ratio(small_cfg, tmp_path):
    """none = verl's plain k3; ratio = ρ·k3 with ρ = π_θ/π_old (the batch's old log-probs are perturbed, so ρ ≠ 1)."""
    batch = _prepared_batch(small_cfg, tmp_path)
    spec_none, spec_ratio = _spec(kl_off_policy_correction="none", mini_batch_size=8), _spec(mini_batch_size=8)
    none, ratio = _actor().update(batch, spec_none, step=1), _actor().update(batch, spec_ratio, step=1)
    assert none["actor/kl_loss"] != pytest.approx(ratio["actor/kl_loss"], rel=1e-3)
    # the first mini-batch is the same
    assert none["policy/pg_loss"] == pytest.approx(ratio["policy/pg_loss"], rel=1e-9)


def test_bypass_mode_measures_pi_theta_against_the_engine_in_the_update(small_cfg, tmp_path):
    run = tmp_path / "r"
    Trainer(
        small_cfg(
            *QUIET,
            *MISMATCH,
            "actor.old_logprobs_source=rollout",
            "algo.rollout_correction.level=token",
            "algo.rollout_correction.mode=mask",
            "algo.rollout_correction.threshold=1.2",
            "algo.mini_batch_size=4",
            out=run,
        )
    ).fit()
    for r in (r for r in metrics(run) if r["step"] > 0):
        assert r["rollout/old_logprobs_from_rollout"] == 1.0
        assert 0 < r["rollout_corr/masked_frac"] < 1  # tokens whose π_θ/π_rollout left [1/1.2, 1.2] gave no gradient
        assert r["rollout_corr/kl"] != 0.0
        assert "rollout_corr/ess" not in r  # the trainer's pass (decoupled mode) did not run


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["algo.rollout_correction.reject=token_k3"], "reject_threshold"),
        (["algo.rollout_correction.level=token", "rollout.mode=offline", "data.response_key=response"], "offline"),
        (
            [
                "algo.rollout_correction.level=token",
                "algo.rollout_correction.batch_normalize=true",
                "actor.old_logprobs_source=rollout",
            ],
            "batch_normalize",
        ),
        (["algo.rollout_correction.level=tokn"], "level"),
        (["algo.rollout_correction.mode=mask", "algo.rollout_correction.lower=3"], "lower"),
        (["kl.off_policy_correction=yes"], "off_policy_correction"),
        # settings that would do nothing (a new-user trial found them accepted silently)
        (["algo.rollout_correction.mode=mask"], r"mode=mask has no effect with level=none"),
        (["algo.rollout_correction.batch_normalize=true"], r"batch_normalize=True has no effect with level=none"),
        (["algo.rollout_correction.reject_threshold=0.1"], r"reject_threshold=0.1 has no effect with reject=none"),
        (
            ["algo.rollout_correction.level=token", "algo.rollout_correction.lower=0.5"],
            r"lower=0.5 is used by mode=mask",
        ),
        (
            ["rollout.mode=offline", "data.response_key=response", "rollout.engine_temperature=1.5"],
            r"rollout.engine_temperature=1.5 has no effect",
        ),
        # a threshold below 1 under mask: the default lower 1/threshold is above it (it crashed at step 1)
        (
            [
                "algo.rollout_correction.level=token",
                "algo.rollout_correction.mode=mask",
                "algo.rollout_correction.threshold=0.5",
            ],
            r"needs lower",
        ),
    ],
)
def test_bad_settings_are_refused_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_a_threshold_below_one_truncates_without_a_lower_bound():
    """truncate never uses lower: threshold=0.5 caps every weight at 0.5 (it crashed at step 1 on the default lower,
    2). So every token's loss is halved, no correction: the config refuses it (naming the key), the function still
    computes it."""
    with pytest.raises(ConfigError, match=r"threshold=0.5 below 1 with mode=truncate caps the weights at 0.5"):
        load_config(None, ["algo.rollout_correction.level=token", "algo.rollout_correction.threshold=0.5"])
    from tether.algos import rollout_correction

    w, _, m = rollout_correction(torch.zeros(1, 2), torch.full((1, 2), -1.0), torch.ones(1, 2), threshold=0.5)
    assert w.tolist() == [[0.5, 0.5]] and m["rollout_corr/truncated_frac"] == 1.0


def test_defaults():
    cfg = load_config(None, [])
    assert cfg.kl.off_policy_correction == "ratio"
    rc = cfg.algo.rollout_correction
    assert (rc.level, rc.mode, rc.threshold, rc.reject, rc.active) == ("none", "truncate", 2.0, "none", False)
