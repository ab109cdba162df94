"""configs/presets/qwen2-7b-kl-ppo*.yaml: the published 7B KL-PPO recipe loads, validates, and builds
and trains on CPU with tiny stand-in models (actor/reference/critic and a reward model)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tether.config import load_config
from tether.data import write_records
from tether.testing import (
    build_gsm8k_tokenizer,
    build_tiny_causal_lm,
    build_tiny_reward_model,
    synthetic_math_texts,
)

PRESETS = Path(__file__).resolve().parents[1] / "configs" / "presets"
BAND, STAGED = PRESETS / "qwen2-7b-kl-ppo.yaml", PRESETS / "qwen2-7b-kl-ppo-staged.yaml"


@pytest.mark.parametrize("path", [BAND, STAGED], ids=["band", "staged"])
def test_preset_is_the_published_recipe(path):
    cfg = load_config(path)
    assert cfg.ref.model == cfg.actor.model and cfg.ref.reset_every == 0  # a frozen SFT reference
    assert cfg.actor.lr == 1e-6 and cfg.actor.grad_clip == 0.5 and cfg.critic.grad_clip == 0.5
    assert cfg.algo.adv_estimator == "gae" and cfg.algo.gamma == 0.99 and cfg.algo.ppo_epochs == 4
    assert cfg.algo.clip_eps_low == cfg.algo.clip_eps_high == 0.2
    assert 16 <= cfg.data.batch_size * cfg.rollout.n <= 64
    assert cfg.rollout.temperature == 0.7 and cfg.rollout.top_p == 0.9
    assert cfg.reward.model is not None and cfg.reward.clip == (-2.0, 2.0)
    assert cfg.trainer.save_freq == 100 and cfg.guard.rollback_drop == 0.05
    assert cfg.trainer.save_freq % cfg.trainer.val_freq == 0  # every checkpoint carries a validation score
    assert cfg.kl.placement == "reward"
    if path == BAND:
        assert (cfg.kl.controller, cfg.kl.coef, cfg.kl.high, cfg.kl.up, cfg.kl.low, cfg.kl.down) == (
            "band",
            0.05,
            0.1,
            1.2,
            0.01,
            0.8,
        )
    else:
        stages = cfg.kl.schedule.stages
        assert cfg.kl.controller == "scheduled" and cfg.kl.coef == stages[0][1] == 0.08 and stages[-1] == (0, 0.03)
        assert [b for _, b in stages] == sorted((b for _, b in stages), reverse=True)


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory):
    root = tmp_path_factory.mktemp("preset")
    tok = build_gsm8k_tokenizer(root / "tok", texts=synthetic_math_texts(200))
    model = build_tiny_causal_lm(root / "sft", tok, arch="qwen2", seed=0)
    rm = build_tiny_reward_model(root / "rm", tok, arch="qwen2", seed=1)
    rows = [{"prompt": [{"role": "user", "content": t.split("\n")[0]}]} for t in synthetic_math_texts(12)]
    write_records(rows[:8], root / "train.jsonl")
    write_records(rows[8:], root / "val.jsonl")
    return model, rm, root


@pytest.mark.slow
@pytest.mark.parametrize("path", [BAND, STAGED], ids=["band", "staged"])
def test_preset_trains_with_tiny_stand_ins(stand_ins, tmp_path, path):
    from tether.trainer import Trainer

    model, rm, root = stand_ins
    cfg = load_config(
        path,
        [
            f"actor.model={model}",
            f"ref.model={model}",
            f"critic.model={model}",
            f"reward.model={rm}",
            f"data.train_files={root / 'train.jsonl'}",
            f"data.val_files={root / 'val.jsonl'}",
            f"trainer.output_dir={tmp_path / 'run'}",
            "trainer.total_steps=2",
            "trainer.progress=false",
            "trainer.report=false",
            "trainer.loggers=[jsonl]",
            "trainer.threads=1",
            "data.batch_size=4",
            "algo.mini_batch_size=2",
            "rollout.max_new_tokens=8",
        ],
    )
    t = Trainer(cfg)
    assert t.roles.critic is not None and t.roles.ref.model is not None and t.roles.ref.model is not t.roles.actor.model
    history = t.fit()
    first, second = history
    for key in ("value/loss", "policy/pg_loss", "reward/score_mean", "kl/ref_mean"):
        assert math.isfinite(first[key]), key
    assert first["policy/updates"] == 4 * 2  # 4 PPO epochs x 2 mini-batches of 2
    assert -2.0 <= first["reward/score_mean"] <= 2.0
    if path == BAND:
        # β starts at 0.05; the policy stays within KL 0.01 of the reference at lr 1e-6, so after each
        # step the band controller multiplies β by 0.8 (kl/coef is the step's β, kl/coef_next the updated one)
        assert first["kl/ref_mean"] < 0.01 and second["kl/ref_mean"] < 0.01
        assert first["kl/coef"] == pytest.approx(0.05) and first["kl/coef_next"] == pytest.approx(0.05 * 0.8)
        assert second["kl/coef"] == pytest.approx(0.05 * 0.8) and second["kl/coef_next"] == pytest.approx(0.05 * 0.8**2)
    else:
        assert first["kl/coef"] == pytest.approx(0.08) and second["kl/coef"] == pytest.approx(0.08)
    assert "val/score_mean" in second and (tmp_path / "run" / "checkpoints" / "step_000002").is_dir()
