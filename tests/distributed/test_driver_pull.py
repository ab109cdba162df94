"""The driver's copy of the policy under trainer.backend=ray (RemoteActor): pulled after every
update when HF rollouts generate on it (eager), only when read when vLLM replicas generate (lazy).

A stand-in worker group that records its calls: no Ray (the real runs are tests/distributed/test_ray.py,
eager, and tests/vllm/test_ray_vllm.py, lazy).
"""

from __future__ import annotations

import pytest
import torch

from tether.distributed.ray_backend import RemoteActor


class _Group:
    """Records calls; ``full_state`` returns the workers' trainable weights: every entry the number of updates so
    far."""

    def __init__(self, model):
        self.workers, self.calls, self.model = ["rank0"], [], model
        self.updates = 0

    def call(self, method, *args, **kwargs):
        self.calls.append(method)
        if method == "update_actor":
            self.updates += 1
            return {"policy/loss": 0.5}
        assert method == "full_state" and args == ("actor", True)
        return {k: torch.full_like(v, float(self.updates)) for k, v in self.model.named_parameters() if v.requires_grad}


@pytest.fixture
def model():
    return torch.nn.Linear(3, 2)


def _update(actor):
    return actor.update(type("B", (), {"response_mask": torch.ones(1, 1)})(), spec=None, step=1)


def test_lazy_copy_is_pulled_once_per_read_after_updates(model):
    group = _Group(model)
    actor = RemoteActor(group, model, lazy=True)
    for _ in range(3):
        assert _update(actor) == {"policy/loss": 0.5}
    assert group.calls == ["update_actor"] * 3 and actor.stale and actor.pulls == 0
    assert actor.model_as_is is model and actor.pulls == 0  # shapes (perf/mfu, checkpoint config): no pull
    assert not torch.equal(model.weight.detach(), torch.full((2, 3), 3.0))
    assert actor.model is model and actor.pulls == 1 and not actor.stale
    # the 3rd update's
    assert torch.equal(model.weight, torch.full((2, 3), 3.0)) and torch.equal(model.bias, torch.full((2,), 3.0))
    actor.model  # noqa: B018 - current: no second pull
    assert actor.pulls == 1 and group.calls.count("full_state") == 1
    _update(actor)
    actor.weights_changed()  # a checkpoint load after the update: still one pull at the next read
    assert actor.pulls == 1
    assert float(actor.model.bias.detach()[0]) == 4.0 and actor.pulls == 2


def test_eager_copy_is_pulled_after_every_update(model):
    group = _Group(model)
    actor = RemoteActor(group, model)
    for i in range(1, 3):
        _update(actor)
        assert actor.pulls == i and not actor.stale and float(model.bias.detach()[1]) == float(i)
    assert group.calls == ["update_actor", "full_state"] * 2


def test_stale_copy_after_the_group_closed_names_the_checkpoint(model):
    group = _Group(model)
    actor = RemoteActor(group, model, lazy=True)
    _update(actor)
    group.workers = None  # WorkerGroup.kill
    with pytest.raises(RuntimeError, match=r"actor worker group is closed.*last checkpoint \(`tether export`\)"):
        actor.model  # noqa: B018
    assert actor.model_as_is is model


class _Tok:
    def save_pretrained(self, out):
        (out / "tokenizer.json").write_text("{}")


def _tiny_lm():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=16, n_positions=8, n_embd=8, n_layer=1, n_head=2))


def test_checkpoint_metadata_pulls_only_for_lora_adapters(tmp_path):
    """A sharded checkpoint's actor/ holds the config (no pull) or, with LoRA, the adapters, which
    must be the trained ones: the stale copy is pulled first."""
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file

    from tether.distributed.ray_backend import save_sharded_actor_meta

    full = _tiny_lm()
    actor = RemoteActor(_Group(full), full, lazy=True)
    _update(actor)
    save_sharded_actor_meta(actor, _Tok(), tmp_path / "full")
    assert actor.pulls == 0 and actor.stale and (tmp_path / "full" / "config.json").is_file()

    lora = get_peft_model(_tiny_lm(), LoraConfig(r=2, target_modules=["c_attn"], fan_in_fan_out=True))
    actor = RemoteActor(_Group(lora), lora, lazy=True)
    _update(actor)
    save_sharded_actor_meta(actor, _Tok(), tmp_path / "lora")
    assert actor.pulls == 1 and not actor.stale
    adapters = load_file(str(tmp_path / "lora" / "adapter_model.safetensors"))
    # the 1st update's weights
    assert len(adapters) == 2 and all(torch.equal(v, torch.ones_like(v)) for v in adapters.values())
