"""Entropy control (algo.entropy_target, algo.top_entropy_quantile) and truncation (algo.mask_truncated,
reward.overlong_buffer) in the trainer and the actor, on the embedded task (issue 21 items 2 and 3)."""

import json
import logging
import math

import pytest
import torch
from test_resume import assert_same_metrics, crash_after, read_lines
from test_resume import cfg as resume_cfg
from test_rollout_correction import _actor, _spec, _weights_after

from tether.algos import overlong_penalty, top_entropy_mask
from tether.config import ConfigError, describe_config, load_config
from tether.trainer import Trainer, TrainingStopped

QUIET = ["trainer.val_freq=0", "trainer.save_freq=0", "trainer.report=false", "trainer.total_steps=3"]


def metrics(run) -> list[dict]:
    return [r for r in (json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()) if r["step"] > 0]


def prepared(t: Trainer):
    """One step's batch up to the update (rollout, reward, log-probs, correction and token masks, KL, advantages)."""
    batch = t.rollout()
    t.score(batch)
    t.compute_logprobs(batch)
    t.correct_rollout(batch)
    t.mask_tokens(batch)
    t.apply_kl(batch)
    t.compute_advantages(batch)
    return batch


# ------------------------------------------------------------------------------------ adaptive α


@pytest.mark.parametrize(
    "target, start, up", [(3.0, 0.0, True), (0.2, 0.05, False)], ids=["below-target-raises", "above-target-lowers"]
)
def test_entropy_coef_follows_dual_ascent_and_reaches_the_actor(small_cfg, tmp_path, target, start, up):
    """α_{t+1} = clip(α_t + lr·(target − policy/entropy_t), 0, α_max), logged as actor/entropy_coef, and the update
    uses the step's α (policy/loss = policy/pg_loss − α·H with the KL in the reward)."""
    run = tmp_path / "r"
    t = Trainer(
        small_cfg(
            *QUIET,
            f"algo.entropy_target={target}",
            f"algo.entropy_coef={start}",
            "algo.entropy_coef_lr=0.02",
            "algo.entropy_coef_max=0.05",
            out=run,
        )
    )
    t.fit()
    lines = metrics(run)
    alphas = [r["actor/entropy_coef"] for r in lines]
    assert alphas[0] == start
    # each step's α from the previous step's logged entropy, by hand
    for prev, nxt in zip(lines[:-1], lines[1:], strict=True):
        want = min(max(prev["actor/entropy_coef"] + 0.02 * (target - prev["policy/entropy"]), 0.0), 0.05)
        assert nxt["actor/entropy_coef"] == pytest.approx(want, abs=1e-7)
    assert (alphas[-1] > alphas[0]) if up else (alphas[-1] < alphas[0])
    assert t.entropy_controller.value == pytest.approx(
        min(max(alphas[-1] + 0.02 * (target - lines[-1]["policy/entropy"]), 0.0), 0.05), abs=1e-7
    )
    # the actor's loss has the step's bonus: loss − pg_loss = −α·(token-mean entropy of π_θ) < 0 where α > 0
    for r in lines:
        bonus = r["policy/loss"] - r["policy/pg_loss"]
        assert bonus < 0 if r["actor/entropy_coef"] > 0 else bonus == 0.0
        # π_θ = π_old at the first mini-batch: the bonus is α times about policy/entropy
        if r["actor/entropy_coef"] > 0:
            assert -bonus / r["actor/entropy_coef"] == pytest.approx(r["policy/entropy"], rel=0.1)


def test_fixed_entropy_coef_is_logged_every_step(small_cfg, tmp_path):
    run = tmp_path / "r"
    t = Trainer(small_cfg(*QUIET, "algo.entropy_coef=0.003", out=run))
    assert t.entropy_controller is None
    t.fit()
    assert [r["actor/entropy_coef"] for r in metrics(run)] == [0.003] * 3


@pytest.mark.slow
def test_adaptive_entropy_and_token_masks_resume_exactly(tmp_path):
    """Crash after step 3, resume from the step-2 checkpoint: every non-timing metric as the uninterrupted run's, α
    included (it moves every step, so matching it means its state was saved and restored)."""
    extra = [
        "data.embedded_train_size=8",
        "algo.entropy_target=2.5",
        "algo.entropy_coef_lr=0.03",
        "algo.top_entropy_quantile=0.5",
        "algo.mask_truncated=true",
        "rollout.temperature=2.0",
        "reward.overlong_buffer=1",
    ]
    full = Trainer(resume_cfg(tmp_path / "full", *extra))
    full.fit()
    want = read_lines(tmp_path / "full")
    run = tmp_path / "run"
    crash_after(Trainer(resume_cfg(run, *extra)), 3)
    state = json.loads((run / "checkpoints" / "step_000002" / "trainer_state.json").read_text())
    assert (
        state["entropy_controller"]["name"] == "entropy_dual_ascent" and state["entropy_controller"]["n_updates"] == 2
    )
    lines = [x for x in (run / "metrics.jsonl").read_text().splitlines() if json.loads(x)["step"] <= 2]
    (run / "metrics.jsonl").write_text("".join(x + "\n" for x in lines))
    resumed = Trainer(resume_cfg(run, *extra))
    assert resumed.step == 2 and resumed.entropy_controller.state_dict() == state["entropy_controller"]
    resumed.fit()
    assert_same_metrics(read_lines(run), want)
    assert resumed.entropy_controller.state_dict() == full.entropy_controller.state_dict()
    steps = [r for r in want if r["step"] > 0]
    assert len({r["actor/entropy_coef"] for r in steps}) == 5  # α moved at every step
    assert all(0.4 < r["actor/entropy_mask_frac"] < 0.6 and "reward/overlong_frac" in r for r in steps)


# ------------------------------------------------------------------------------------ top-entropy tokens


def test_top_entropy_quantile_keeps_about_half_the_tokens(small_cfg, tmp_path):
    run = tmp_path / "r"
    # kl in the loss, one mini-batch: the update's own log-probs would serve as π_old, but the mask needs the entropy
    # first
    t = Trainer(
        small_cfg(*QUIET, "algo.top_entropy_quantile=0.5", "kl.placement=loss", "algo.mini_batch_size=16", out=run)
    )
    batch = prepared(t)
    assert batch.old_logprobs is not None and batch.entropy is not None  # the separate no-grad pass ran
    counted = batch.response_mask.bool()
    values = torch.sort(batch.entropy[counted].double()).values
    n = values.numel()
    # the median, by hand
    tau = values[(n - 1) // 2] + (0.5 * (n - 1) - (n - 1) // 2) * (values[n // 2] - values[(n - 1) // 2])
    torch.testing.assert_close(batch.entropy_mask, counted & (batch.entropy.double() >= tau), rtol=0, atol=0)
    kept = int(batch.entropy_mask.sum())
    # no tie at τ in this batch (a group's first tokens share one state, so their entropies tie)
    assert kept == math.ceil(n / 2)
    assert batch.extra["control_metrics"]["actor/entropy_mask_frac"] == kept / n
    t.fit()
    for r in metrics(run):
        assert abs(r["actor/entropy_mask_frac"] - 0.5) <= 1 / 16, r["actor/entropy_mask_frac"]  # ties at τ are kept
        assert "actor/masked_truncated" not in r


def _unperturbed_batch(small_cfg, tmp_path):
    t = Trainer(small_cfg(*QUIET, out=tmp_path / "b"))
    batch = prepared(t)
    batch.entropy_mask, _ = top_entropy_mask(batch.entropy, batch.response_mask, 0.5)
    return batch


def _copy(batch):
    return batch.select(list(range(len(batch))))


def test_entropy_mask_weighs_the_policy_loss_only(small_cfg, tmp_path):
    """Changing the advantages of masked-out tokens changes nothing; the KL term still sees every token; the loss's
    denominator is still every counted token (TRL: the mask multiplies the per-token loss)."""
    batch = _unperturbed_batch(small_cfg, tmp_path)
    out = (~batch.entropy_mask) & batch.response_mask.bool()
    assert out.any() and batch.entropy_mask.any()
    actor = _actor()
    base = actor.update(batch, _spec(), step=1)
    w_base = _weights_after(actor)

    moved = _copy(batch)
    moved.advantages = torch.where(out, batch.advantages + 5.0, batch.advantages)  # only masked-out tokens
    actor = _actor()
    m = actor.update(moved, _spec(), step=1)
    assert m["policy/loss"] == base["policy/loss"]
    for a, b in zip(_weights_after(actor), w_base, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)

    kl_moved = _copy(batch)
    # the KL at masked-out tokens
    kl_moved.ref_logprobs = torch.where(out, batch.ref_logprobs - 1.0, batch.ref_logprobs)
    assert _actor().update(kl_moved, _spec(), step=1)["actor/kl_loss"] > base["actor/kl_loss"] + 0.01

    # ratio 1 (π_θ = π_old at step 1): vanilla's token loss is −A, so pg_loss = −Σ_kept A / (every counted token)
    counted = batch.response_mask.bool()
    want = -float(torch.where(batch.entropy_mask, batch.advantages, 0.0).sum()) / int(counted.sum())
    assert base["policy/pg_loss"] == pytest.approx(want, abs=1e-5)


# ------------------------------------------------------------------------------------ truncation


def test_mask_truncated_takes_cut_responses_out_of_the_loss(small_cfg, tmp_path):
    run = tmp_path / "r"
    # at temperature 3 the tiny model often writes a 4th digit instead of EOS: some responses are cut at 4 tokens
    t = Trainer(small_cfg(*QUIET, "algo.mask_truncated=true", "rollout.temperature=3.0", out=run))
    batch = prepared(t)
    cut = batch.truncated
    assert 0 < int(cut.sum()) < len(batch), cut
    assert torch.equal(cut, ~(batch.response_ids == t.tok.eos_token_id).any(-1))
    assert torch.equal(batch.loss_mask, batch.response_mask.bool() & ~cut[:, None])
    assert torch.equal(batch.update_mask.sum(-1) > 0, ~cut)
    assert batch.extra["control_metrics"]["actor/masked_truncated"] == float(cut.sum())
    # out of the loss: NaN advantages on the cut responses cannot reach it (they would make the step non-finite)
    batch.advantages = torch.where(cut[:, None], float("nan"), batch.advantages)
    m = t.update_actor(batch)
    # 2 mini-batches of 8
    assert m["guard/nonfinite_skip"] == 0 and m["policy/updates"] == 2 and math.isfinite(m["policy/loss"])
    batch.loss_mask = None
    assert t.update_actor(batch)["guard/nonfinite_skip"] >= 1  # the same batch with them in the loss
    t.fit()
    for r in metrics(run):  # the count of cut responses is the existing response/truncated_frac's share of the batch
        assert r["actor/masked_truncated"] == pytest.approx(r["response/truncated_frac"] * 16, abs=1e-9)


def test_all_responses_cut_trains_nothing_and_warns(small_cfg, tmp_path, caplog):
    t = Trainer(
        small_cfg(
            *QUIET, "algo.mask_truncated=true", "rollout.max_new_tokens=3", "trainer.total_steps=1", out=tmp_path / "r"
        )
    )
    before = _weights_after(t.roles.actor)
    # a run that trained no token ends as an all-failing reward does (issue 33): an error, not done
    with caplog.at_level(logging.WARNING, logger="tether"), pytest.raises(TrainingStopped, match="no token of all 1"):
        t.fit()
    assert "algo.mask_truncated took all 16 responses out of the loss" in caplog.text
    r = metrics(tmp_path / "r")[0]
    assert r["actor/masked_truncated"] == 16 and r["response/truncated_frac"] == 1.0
    # no token, no gradient: AdamW's first step moves nothing
    for a, b in zip(_weights_after(t.roles.actor), before, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_overlong_penalty_is_added_to_the_scores(small_cfg, tmp_path):
    run = tmp_path / "r"
    t = Trainer(small_cfg(*QUIET, "reward.overlong_buffer=2", "rollout.temperature=2.0", out=run))
    batch = t.rollout()
    t.score(batch)
    raw = t.roles.reward(batch.rows, batch.prompts, batch.responses).scores
    lengths = batch.response_lengths
    # L_max = 4, L_cache = 2: 2 tokens free, 3 tokens −0.5, 4 tokens (3 digits and EOS, or a cut one) −1
    pen = torch.tensor([{0: 0.0, 1: 0.0, 2: 0.0, 3: -0.5, 4: -1.0}[n] for n in lengths.tolist()])
    assert set(lengths.tolist()) >= {3, 4}
    torch.testing.assert_close(pen, overlong_penalty(lengths, 4, 2), rtol=0, atol=0)
    torch.testing.assert_close(batch.scores, raw + pen, rtol=0, atol=1e-7)
    rm = batch.extra["reward_metrics"]
    assert rm["reward/overlong_penalty_mean"] == pytest.approx(float(pen.mean()), abs=1e-7)
    assert rm["reward/overlong_frac"] == float((pen < 0).float().mean())
    t.fit()
    for r in metrics(run):
        assert -1.0 <= r["reward/overlong_penalty_mean"] < 0 and 0 < r["reward/overlong_frac"] <= 1


# ------------------------------------------------------------------------------------ config


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["algo.top_entropy_quantile=0"], "algo.top_entropy_quantile"),
        (["algo.top_entropy_quantile=1.5"], "algo.top_entropy_quantile"),
        (["algo.entropy_target=-0.1"], "algo.entropy_target"),
        (["algo.entropy_target=1", "algo.entropy_coef_lr=0"], "algo.entropy_coef_lr"),
        (
            ["algo.entropy_target=1", "algo.entropy_coef=0.2"],
            r"algo.entropy_coef=0.2 .* must not exceed algo.entropy_coef_max=0.1",
        ),
        (["algo.entropy_coef_max=0.5"], r"algo.entropy_coef_max=0.5 has no effect without algo.entropy_target"),
        (
            ["algo.entropy_target=1", "actor.old_logprobs_source=rollout"],
            r"algo.entropy_target=1.0 needs π_old's entropy.*actor.old_logprobs_source=rollout",
        ),
        (
            ["algo.top_entropy_quantile=0.2", "actor.old_logprobs_source=rollout"],
            r"algo.top_entropy_quantile=0.2 needs π_old's entropy.*actor.old_logprobs_source=recompute",
        ),
        (["reward.overlong_buffer=4"], r"reward.overlong_buffer=4 must be below rollout.max_new_tokens=4"),
        (["reward.overlong_buffer=-1"], "reward.overlong_buffer"),
        (["reward.overlong_penalty=0.5"], r"reward.overlong_penalty=0.5 has no effect without reward.overlong_buffer"),
        (["reward.overlong_buffer=2", "reward.overlong_penalty=0"], "reward.overlong_penalty"),
        (["algo.mask_truncated=maybe"], "algo.mask_truncated"),
    ],
)
def test_bad_settings_are_refused_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_defaults_are_off_and_documented():
    a, r = load_config(None, []).algo, load_config(None, []).reward
    assert (a.entropy_target, a.entropy_coef_lr, a.entropy_coef_max, a.top_entropy_quantile, a.mask_truncated) == (
        None,
        0.01,
        0.1,
        1.0,
        False,
    )
    assert (r.overlong_buffer, r.overlong_penalty) == (None, 1.0)
    text = describe_config()
    for key in (
        "algo.entropy_target",
        "algo.entropy_coef_lr",
        "algo.entropy_coef_max",
        "algo.top_entropy_quantile",
        "algo.mask_truncated",
        "reward.overlong_buffer",
        "reward.overlong_penalty",
    ):
        assert key in text, key
    # reward.overlong_buffer=0 is off, like null; buffer 3 < max_new_tokens 4 is accepted
    assert load_config(None, ["reward.overlong_buffer=0"]).reward.overlong_buffer == 0
    assert load_config(None, ["reward.overlong_buffer=3", "reward.overlong_penalty=0.5"]).reward.overlong_penalty == 0.5
