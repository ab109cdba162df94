"""The reference policy: LoRA adapters with the adapter-disabled model as π_ref (no second copy),
LoRA checkpoints (save, resume, export), and ref.reset_every."""

from __future__ import annotations

import pytest
import torch

from tether.config import ConfigError
from tether.export import export_checkpoint
from tether.models import load_causal_lm
from tether.trainer import Trainer
from tether.workers import ReferenceWorker

pytestmark = pytest.mark.slow

LORA = [
    "actor.lora.rank=4",
    "actor.lora.alpha=8",
    "actor.lr=1e-2",
    "trainer.val_freq=0",
    "trainer.report=false",
    "trainer.loggers=[jsonl]",
]


def _split(model):
    base = {k: v.detach().clone() for k, v in model.named_parameters() if "lora_" not in k}
    lora = {k: v.detach().clone() for k, v in model.named_parameters() if "lora_" in k}
    return base, lora


def test_lora_trains_adapters_and_the_reference_is_the_base_model(small_cfg):
    t = Trainer(small_cfg(*LORA, "trainer.total_steps=2"))
    actor = t.roles.actor.model
    assert t.roles.ref.model is None and t.roles.ref.adapter_host is actor  # no second copy
    trainable = {k for k, p in actor.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in k for k in trainable)
    base0, lora0 = _split(actor)
    t.fit()
    base1, lora1 = _split(actor)
    assert all(torch.equal(base0[k], base1[k]) for k in base0), "a base weight moved"
    assert any(not torch.equal(lora0[k], lora1[k]) for k in lora0), "the adapters did not train"
    # one copy of the base weights in memory: the actor's parameters are base + adapters, nothing else
    base_model = load_causal_lm(t.roles.actor_path).to(t.device)
    n_base = sum(p.numel() for p in base_model.parameters())
    assert sum(p.numel() for p in actor.parameters()) == n_base + sum(v.numel() for v in lora1.values())
    # π_ref = the base model: the adapter-disabled log-probs equal a fresh base model's, exactly
    batch = t.rollout()
    ref_lp = t.roles.ref.compute_logprobs(batch)
    base_lp = ReferenceWorker(base_model, micro_batch_size=64, temperature=t.cfg.rollout.temperature).compute_logprobs(
        batch
    )
    mask = batch.response_mask.bool()
    torch.testing.assert_close(ref_lp[mask], base_lp[mask], rtol=0, atol=1e-6)
    actor_lp, _, _, _ = t.roles.actor.compute_logprobs(batch, with_entropy=False)
    assert float((actor_lp - ref_lp)[mask].abs().max()) > 1e-3, "the trained policy equals the reference"


def test_lora_checkpoint_resume_and_export(small_cfg, tmp_path):
    out = tmp_path / "run"
    a = Trainer(small_cfg(*LORA, "trainer.total_steps=2", "trainer.save_freq=1", out=out))
    a.fit()
    ckpt = out / "checkpoints" / "step_000002"
    files = {f.name for f in (ckpt / "actor").iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json"} <= files and "model.safetensors" not in files
    _, lora_a = _split(a.roles.actor.model)

    b = Trainer(small_cfg(*LORA, "trainer.total_steps=3", "trainer.save_freq=1", out=out))
    assert b.step == 2
    _, lora_b = _split(b.roles.actor.model)
    assert lora_a.keys() == lora_b.keys() and all(torch.equal(lora_a[k], lora_b[k]) for k in lora_a)
    assert b.roles.ref.adapter_host is b.roles.actor.model
    b.fit()
    assert b.step == 3

    merged = load_causal_lm(export_checkpoint(ckpt, tmp_path / "export")).to(a.device)
    assert not any("lora_" in k for k, _ in merged.named_parameters())
    batch = a.rollout()
    want, _, _, _ = a.roles.actor.compute_logprobs(batch, with_entropy=False)
    got = ReferenceWorker(merged, micro_batch_size=64, temperature=a.cfg.rollout.temperature).compute_logprobs(batch)
    mask = batch.response_mask.bool()
    torch.testing.assert_close(got[mask], want[mask], rtol=0, atol=1e-5)


def test_ref_reset_every_moves_the_reference_to_the_policy(small_cfg):
    t = Trainer(
        small_cfg(
            "ref.reset_every=2",
            "trainer.total_steps=3",
            "trainer.val_freq=0",
            "trainer.report=false",
            "trainer.loggers=[jsonl]",
        )
    )
    ref, actor = t.roles.ref.model, t.roles.actor.model
    snap = lambda m: {k: v.detach().clone() for k, v in m.state_dict().items()}  # noqa: E731
    same = lambda a, b: all(torch.equal(a[k], b[k]) for k in a)  # noqa: E731
    ref0 = snap(ref)
    t.train_step()  # step 1: no reset; the actor moved away from the reference
    assert same(snap(ref), ref0) and not same(snap(actor), ref0)
    t.train_step()  # step 2: reset after the update
    actor2 = snap(actor)
    assert same(snap(ref), actor2) and not same(actor2, ref0)
    t.train_step()  # step 3: the reference stays at the step-2 policy while the actor moves on
    assert same(snap(ref), actor2) and not same(snap(actor), actor2)
    assert ref is not actor and not any(p.requires_grad for p in ref.parameters())
    t.logger.close()


def test_ref_reset_every_with_lora_is_a_config_error(small_cfg):
    with pytest.raises(ConfigError, match="ref.reset_every"):
        Trainer(small_cfg("actor.lora.rank=4", "ref.reset_every=2"))
