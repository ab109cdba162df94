"""``actor.attn_implementation`` and ``actor.lm_head_fp32`` as the trainer sets them up (local backend)."""

import math

import pytest

from tether.config import ConfigError
from tether.trainer import Trainer


def _attn(model) -> str:
    return model.config._attn_implementation


def test_bf16_on_cpu_takes_tether_attention_and_an_fp32_head_by_default(small_cfg):
    trainer = Trainer(small_cfg("actor.compute_dtype=bfloat16", "algo.adv_estimator=gae"))
    actor, ref, critic = trainer.roles.actor.model, trainer.roles.ref.model, trainer.roles.critic.model.backbone
    assert (_attn(actor), _attn(ref), _attn(critic)) == ("tether", "tether", "tether")
    assert actor.get_output_embeddings()._tether_patch == ref.get_output_embeddings()._tether_patch == {"fp32": True}
    m = trainer.train_step()
    assert (
        math.isfinite(m["kl/ref_mean"])
        and math.isfinite(m["policy/pg_loss"])
        and math.isfinite(m["critic/values_mean"])
    )


def test_float32_keeps_the_models_own_attention(small_cfg):
    trainer = Trainer(small_cfg())
    assert _attn(trainer.roles.actor.model) == "sdpa" and _attn(trainer.roles.ref.model) == "sdpa"


@pytest.mark.parametrize("setting, expected", [("model", "sdpa"), ("eager", "eager"), ("tether", "tether")])
def test_an_explicit_attn_implementation_is_used_as_given(small_cfg, setting, expected):
    trainer = Trainer(small_cfg("actor.compute_dtype=bfloat16", f"actor.attn_implementation={setting}"))
    assert _attn(trainer.roles.actor.model) == expected and _attn(trainer.roles.ref.model) == expected


def test_lm_head_fp32_false_leaves_the_head_under_autocast(small_cfg):
    trainer = Trainer(small_cfg("actor.compute_dtype=bfloat16", "actor.lm_head_fp32=false"))
    for model in (trainer.roles.actor.model, trainer.roles.ref.model):
        assert model.get_output_embeddings()._tether_patch == {"fp32": False}  # contiguous input only
    m = trainer.train_step()
    assert math.isfinite(m["kl/ref_mean"])


def test_an_unknown_attn_implementation_fails_at_start_naming_the_key(small_cfg):
    with pytest.raises(ConfigError, match=r"actor.attn_implementation='flash_nope'"):
        Trainer(small_cfg("actor.attn_implementation=flash_nope"))
