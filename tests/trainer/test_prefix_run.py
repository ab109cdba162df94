"""actor.share_prompt_prefix end to end: a run with each prompt once per micro-batch is the run
without it, up to float round-off (the embedded task: 4 prompts × rollout.n = 4 per step)."""

import math

import pytest
import torch
from error_model import lockstep, reduction_tol, update_terms

import tether.models.prefix as prefix
from tether.trainer import Trainer

pytestmark = pytest.mark.slow

KEYS = (
    "reward/score_mean",
    "kl/ref_mean",
    "policy/entropy",
    "policy/loss",
    "policy/pg_loss",
    "policy/approx_kl",
    "policy/clipfrac",
    "policy/grad_norm",
    "ref/logprob_mean",
)


def _trainer(small_cfg, tmp_path, name, *overrides):
    return Trainer(
        small_cfg(
            "trainer.val_freq=0",
            "trainer.save_freq=0",
            "trainer.report=false",
            "actor.micro_batch_size=8",
            *overrides,
            out=tmp_path / name,
        )
    )


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param(
            ["kl.placement=loss", "kl.estimator=k3", "kl.coef=0.05", "algo.mini_batch_size=16"], id="grpo-kl-loss-reuse"
        ),
        pytest.param(
            ["kl.placement=reward", "algo.adv_estimator=gae", "critic.micro_batch_size=8"], id="gae-kl-reward"
        ),
    ],
)
@pytest.mark.kernels
def test_shared_prompt_run_equals_the_ordinary_run(small_cfg, tmp_path, monkeypatch, overrides):
    """Each step from the same state (error_model.lockstep: the same samples, bitwise). Error model
    (tests/error_model.py): the shared pass runs each prompt once per micro-batch, other shapes than the ordinary
    pass, so log-probs differ by rounding; the metrics are reductions over n = 16 rows × 10 positions + 256 = 416 O(1)
    terms, compared at n·u = 2.5e-5, each step's actor (and critic) weights at AdamTrace's one-step bound. (Two free
    runs of 2 steps, compared at rel 1e-5, failed under SSE4.2 kernels: kl/ref_mean 1.1e-4 apart.)"""
    calls = []
    real = prefix.shared_prefix_outputs
    monkeypatch.setattr(prefix, "shared_prefix_outputs", lambda *a, **k: calls.append(1) or real(*a, **k))
    trainers = {
        name: _trainer(small_cfg, tmp_path, name, *overrides, f"actor.share_prompt_prefix={share}")
        for name, share in (("shared", "true"), ("plain", "false"))
    }
    used = []
    for t in trainers.values():  # which trainers' passes ran the shared path
        step = t.train_step

        def counted(_step=step):
            n = len(calls)
            out = _step()
            used.append(len(calls) > n)
            return out

        t.train_step = counted
    runs, traces, spans = lockstep(trainers, 2)
    assert used == [True, False, True, False]  # the shared path ran in the shared run only
    keys = KEYS + (("value/loss",) if "algo.adv_estimator=gae" in overrides else ())
    config = trainers["plain"].roles.actor.model.config
    for s, (a, b) in enumerate(zip(runs["shared"], runs["plain"], strict=True)):
        assert torch.equal(a["batch"].response_ids, b["batch"].response_ids), s
        n = update_terms(a["batch"], config)
        tol = reduction_tol(n)
        for k in keys:
            assert math.isclose(a["metrics"][k], b["metrics"][k], rel_tol=tol, abs_tol=tol), (s, k)
        for role in traces:
            traces[role].check(b[role], a[role], n, spans[role][s], what=(s, role))
