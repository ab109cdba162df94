"""Multi-turn masks in the trainer and the actor: tokens the environment appended (``generated_mask`` 0, in the
middle of a response) take no part in the KL (reward and metrics), the rewards, the advantages, the policy loss, the
KL loss, the entropy or the top-entropy mask; and ``kl.loss_to_go`` in a run. The batch is a real rollout of the
embedded task with a two-token "observation" marked inside each response that is long enough."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from tether.config import ConfigError
from tether.tasks.sft import default_reference_path
from tether.trainer import Trainer
from tether.workers import ActorWorker
from tether.workers.actor import ActorUpdateSpec

QUIET = ["trainer.val_freq=0", "trainer.save_freq=0", "trainer.report=false", "trainer.total_steps=2"]


def _with_observations(small_cfg, tmp_path, *overrides):
    """A scored batch with old/ref log-probs; positions 1 and 2 of each response with ≥ 4 tokens become an
    observation (generated_mask 0). Returns (trainer, batch, obs (B, T) bool)."""
    t = Trainer(small_cfg(*QUIET, *overrides, out=tmp_path / "r"))
    batch = t.rollout()
    t.score(batch)
    t.compute_logprobs(batch)
    # the actor starts as the reference (KL 0): move the reference's log-probs so that the KL is not 0
    noise = 0.3 * torch.randn(batch.ref_logprobs.shape, generator=torch.Generator().manual_seed(1))
    batch.ref_logprobs = batch.ref_logprobs + torch.where(batch.response_mask.bool(), noise, 0.0)
    obs = torch.zeros_like(batch.response_mask, dtype=torch.bool)
    long = batch.response_mask.sum(-1) >= 4
    obs[long, 1:3] = True
    assert int(long.sum()) >= 2
    batch.generated_mask = (batch.response_mask.bool() & ~obs).long()
    batch.loss_mask = batch.generated_mask.bool()
    return t, batch, obs


def _garbage(batch, obs, value: float) -> None:
    """Overwrite what a batch holds at observation positions (log-probs, entropy) with ``value``."""
    for name in ("old_logprobs", "ref_logprobs", "entropy"):
        x = getattr(batch, name)
        setattr(batch, name, torch.where(obs, torch.full_like(x, value), x))


def _phases(t, batch) -> dict:
    t.apply_kl(batch)
    t.compute_advantages(batch)
    return t.step_metrics(batch)


def test_observation_tokens_take_no_part_in_the_kl_rewards_advantages_or_metrics(small_cfg, tmp_path):
    t, batch, obs = _with_observations(small_cfg, tmp_path)
    other = batch.select(list(range(len(batch))))
    _garbage(batch, obs, -3.0)
    _garbage(other, obs, -40.0)
    m1, m2 = _phases(t, batch), _phases(t, other)
    for name in ("kl", "token_level_rewards", "advantages"):
        a, b = getattr(batch, name), getattr(other, name)
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        assert bool((a[obs] == 0).all()), name
    for key in ("kl/ref_mean", "kl/ref_seq_mean", "kl/k3_mean", "policy/entropy", "ref/logprob_mean"):
        assert m1[key] == m2[key], key
    # each response's score sits on its last model token (here never an observation: obs is in the middle)
    counted = batch.response_mask.sum(-1) > 0
    assert m1["response/length_mean"] == pytest.approx(float(batch.response_mask.sum(-1)[counted].float().mean()))
    assert m1["response/model_length_mean"] == pytest.approx(
        m1["response/length_mean"] - 2 * float((obs.any(-1) & counted).sum()) / float(counted.sum())
    )


def test_observation_tokens_take_no_part_in_the_top_entropy_mask(small_cfg, tmp_path):
    t, batch, obs = _with_observations(small_cfg, tmp_path, "algo.top_entropy_quantile=0.5")
    batch.entropy = torch.where(obs, torch.full_like(batch.entropy, 1e3), batch.entropy)  # the "highest" entropy
    t.mask_tokens(batch)
    assert not bool(batch.entropy_mask[obs].any())
    assert bool(batch.entropy_mask.any())


def _actor() -> ActorWorker:
    torch.manual_seed(0)
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
        entropy_coef=0.01,
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


def _weights(actor: ActorWorker) -> list[torch.Tensor]:
    return [p.detach().clone() for p in actor.model.parameters()]


def test_observation_tokens_take_no_part_in_the_update(small_cfg, tmp_path):
    """Policy loss, KL loss (with the KL-to-go term) and entropy bonus: what the batch holds at observation
    positions (old/ref log-probs, advantages) changes neither the update's metrics nor its weights."""
    t, batch, obs = _with_observations(small_cfg, tmp_path)
    t.apply_kl(batch)
    t.compute_advantages(batch)
    other = batch.select(list(range(len(batch))))
    _garbage(other, obs, -40.0)
    other.advantages = torch.where(obs, torch.full_like(other.advantages, 7.0), other.advantages)
    out = []
    for b in (batch, other):
        actor = _actor()
        out.append((actor.update(b, _spec(kl_loss_to_go=True), step=1), _weights(actor)))
    for key in ("policy/loss", "policy/pg_loss", "actor/kl_loss"):
        assert out[0][0][key] == out[1][0][key], key
    for a, b in zip(out[0][1], out[1][1], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_kl_loss_to_go_keeps_the_loss_value_and_changes_the_gradient(small_cfg, tmp_path):
    """The term is 0 in value (``actor/kl_loss`` unchanged) and adds the score times the later KL to the gradient."""
    t, batch, _ = _with_observations(small_cfg, tmp_path)
    t.apply_kl(batch)
    t.compute_advantages(batch)
    off, on = _actor(), _actor()
    m_off, m_on = off.update(batch, _spec(), step=1), on.update(batch, _spec(kl_loss_to_go=True), step=1)
    assert m_on["actor/kl_loss"] == pytest.approx(m_off["actor/kl_loss"], rel=1e-6)
    diff = max(float((a - b).abs().max()) for a, b in zip(_weights(off), _weights(on), strict=True))
    assert diff > 1e-6


def test_kl_loss_to_go_trains_two_steps_and_logs(small_cfg, tmp_path):
    run = tmp_path / "r"
    Trainer(small_cfg(*QUIET, "kl.placement=loss", "kl.estimator=k3", "kl.loss_to_go=true", out=run)).fit()
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] > 0]
    assert len(steps) == 2
    for r in steps:
        assert r["actor/kl_loss"] == r["actor/kl_loss"]  # finite, logged
        assert "response/model_length_mean" in r


def test_kl_loss_to_go_needs_the_kl_in_the_loss(small_cfg):
    with pytest.raises(ConfigError, match=r"kl.loss_to_go=true .* kl.placement=reward"):
        small_cfg("kl.loss_to_go=true")
