"""actor/critic padding_free + max_tokens_per_micro_batch through the trainer: the same run as the padded path."""

import math

import pytest
import torch

from tether.trainer import Trainer

pytestmark = pytest.mark.slow

COMMON = [
    "algo.adv_estimator=gae",
    "kl.placement=reward",
    "trainer.val_freq=0",
    "trainer.save_freq=0",
    "trainer.report=false",
    "actor.micro_batch_size=4",
    "critic.micro_batch_size=4",
]
PACKED = [
    "actor.padding_free=true",
    "actor.max_tokens_per_micro_batch=40",
    "critic.padding_free=true",
    "critic.max_tokens_per_micro_batch=40",
]
SAME = (
    "reward/score_mean",
    "kl/ref_mean",
    "policy/entropy",
    "policy/loss",
    "policy/pg_loss",
    "policy/approx_kl",
    "policy/clipfrac",
    "policy/grad_norm",
    "value/loss",
    "value/clipfrac",
    "value/grad_norm",
)


def test_packed_token_budget_run_equals_the_padded_run(small_cfg, tmp_path):
    runs = {}
    for name, extra in (("padded", []), ("packed", PACKED)):
        t = Trainer(small_cfg(*COMMON, *extra, out=tmp_path / name))
        runs[name] = (t, [t.train_step() for _ in range(2)])
    (pad, h_pad), (packed, h_packed) = runs["padded"], runs["packed"]
    assert packed.roles.actor.micro.padding_free and packed.roles.critic.micro.max_tokens == 40
    for a, b in zip(h_pad, h_packed, strict=True):
        for k in SAME:
            assert math.isclose(a[k], b[k], rel_tol=1e-5, abs_tol=1e-6), (k, a[k], b[k])
    assert h_pad[-1]["value/loss"] > 0 and h_pad[-1]["policy/grad_norm"] > 0
    for (k, p), q in zip(
        pad.roles.actor.model.state_dict().items(), packed.roles.actor.model.state_dict().values(), strict=True
    ):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=0, msg=k)
