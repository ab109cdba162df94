"""tether.distributed.rollout_workers without a vLLM: how requests are split across replicas and
merged back, how weights are bucketed, the gathered weights' names and values (LoRA merged), and
the config keys. The real engine and Ray: tests/vllm/test_ray_vllm.py (make test-vllm)."""

from __future__ import annotations

import pytest
import torch

from tether.config import ConfigError, describe_config, load_config
from tether.distributed.rollout_workers import ReplicaGroup, split_rows
from tether.distributed.weights import iter_full_weights, weight_buckets


def test_split_rows_contiguous_and_balanced():
    assert split_rows(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert split_rows(8, 2) == [(0, 4), (4, 8)]
    assert split_rows(2, 3) == [(0, 1), (1, 2)]  # an idle replica gets no call
    assert split_rows(5, 1) == [(0, 5)]


def test_replica_group_splits_requests_in_order_and_seeds_each_replica():
    """The driver's group sends contiguous chunks of the requests to its replicas, replica i with seed s + i (s one
    draw from the caller's RNG, or the given seed), and returns every result in the requests' order (no Ray needed:
    the replicas and the gather are stand-ins)."""
    from types import SimpleNamespace

    from tether.rollout import GenerationRequest, GenerationResult

    sent = []

    def replica(i):
        def remote(requests, seed):
            sent.append((i, [r.prompt_ids[0] for r in requests], seed))
            return [GenerationResult([r.prompt_ids[0] * 10, 2], None, "eos") for r in requests]

        return SimpleNamespace(generate=SimpleNamespace(remote=remote))

    group = ReplicaGroup.__new__(ReplicaGroup)
    group.replicas, group.n, group.sleeps = [replica(i) for i in range(3)], 3, False
    group._get = lambda refs, what: list(refs)
    requests = [GenerationRequest([k]) for k in range(1, 8)]
    out = group.generate(requests, seed=100)
    assert [r.token_ids[0] for r in out] == [10, 20, 30, 40, 50, 60, 70]
    assert sent == [(0, [1, 2, 3], 100), (1, [4, 5], 101), (2, [6, 7], 102)]
    torch.manual_seed(0)
    group.generate(requests[:2])
    torch.manual_seed(0)
    drawn = int(torch.randint(0, 2**31 - 1, (1,)).item())
    assert [s for _, _, s in sent[3:]] == [drawn, drawn + 1]  # one replica idle: no call


def _t(n_floats: int) -> torch.Tensor:
    return torch.zeros(n_floats)  # float32: 4 bytes each


def test_weight_buckets_close_on_size_but_never_split_a_block():
    weights = [
        ("model.embed_tokens.weight", _t(10)),  # 40 B
        ("model.layers.0.q.weight", _t(10)),  # 40 B: 80 > 64, a new bucket
        ("model.layers.0.k.weight", _t(10)),  # same block: stays although the bucket is 80 B
        ("model.layers.1.q.weight", _t(4)),  # 16 B, another block: 96 > 64, a new bucket
        ("model.layers.1.k.weight", _t(4)),
        ("model.norm.weight", _t(4)),  # 48 B fits
        ("lm_head.weight", _t(10)),  # 88 > 64: a new bucket
    ]
    buckets = [[n for n, _ in b] for b in weight_buckets(iter(weights), 64)]
    assert buckets == [
        ["model.embed_tokens.weight"],
        ["model.layers.0.q.weight", "model.layers.0.k.weight"],
        ["model.layers.1.q.weight", "model.layers.1.k.weight", "model.norm.weight"],
        ["lm_head.weight"],
    ]
    assert [[n for n, _ in b] for b in weight_buckets(iter(weights), 10**9)] == [[n for n, _ in weights]]


def _tiny_lm():
    from tether.models import load_causal_lm, resolve_model_path

    return load_causal_lm(resolve_model_path("embedded"))


def test_iter_full_weights_of_an_unsharded_model_is_its_state_dict():
    from tether.rollout.vllm import iter_hf_named_weights

    model = _tiny_lm()
    got, want = list(iter_full_weights(model)), list(iter_hf_named_weights(model))
    assert [n for n, _ in got] == [n for n, _ in want] == list(model.state_dict())
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, want, strict=True))


def test_iter_full_weights_merges_lora_as_peft_does():
    """W + scaling · B @ A with a nonzero B (scaling = alpha / rank = 2), under the base names: equal
    to the merged weights of peft's merge_and_unload of a copy, to float32 rounding."""
    import copy

    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        _tiny_lm(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    )
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    merged = copy.deepcopy(model).merge_and_unload().state_dict()
    got = dict(iter_full_weights(model))
    assert list(got) == list(merged)
    for name, w in merged.items():
        assert torch.allclose(got[name], w, atol=1e-6, rtol=0), name
    q = "model.layers.0.self_attn.q_proj.weight"
    assert (
        float((got[q] - model.get_base_model().state_dict()[q.replace(".weight", ".base_layer.weight")]).abs().max())
        > 0.01
    )


def test_vllm_replica_keys_in_help_and_validated():
    text = describe_config()
    for key in (
        "rollout.vllm.replicas",
        "rollout.vllm.tensor_parallel_size",
        "rollout.vllm.sync_bucket_mib",
        "rollout.vllm.sleep",
    ):
        assert key in text, key
    ray = ["trainer.backend=ray", "rollout.engine=vllm"]
    cfg = load_config(
        None, [*ray, "rollout.vllm.replicas=3", "rollout.vllm.tensor_parallel_size=2", "trainer.placement=split"]
    )
    assert (cfg.rollout.vllm.replicas, cfg.rollout.vllm.tensor_parallel_size, cfg.rollout.vllm.sync_bucket_mib) == (
        3,
        2,
        64.0,
    )
    with pytest.raises(ConfigError, match=r"rollout.vllm.replicas=2 needs trainer.backend=ray"):
        load_config(None, ["rollout.vllm.replicas=2"])
    with pytest.raises(ConfigError, match=r"rollout.vllm.tensor_parallel_size=2 needs trainer.backend=ray"):
        load_config(None, ["rollout.vllm.tensor_parallel_size=2"])
    # settings that would be ignored
    with pytest.raises(ConfigError, match=r"rollout.vllm.replicas=3 has no effect with rollout.engine=hf"):
        load_config(None, ["trainer.backend=ray", "rollout.engine=hf", "rollout.vllm.replicas=3"])
    with pytest.raises(
        ConfigError, match=r"rollout.vllm.replicas=3 has no effect with rollout.engine=auto under trainer.backend=ray"
    ):
        # auto keeps HF under Ray
        load_config(None, ["trainer.backend=ray", "rollout.engine=auto", "rollout.vllm.replicas=3"])
    for key, value in (
        ("n_workers", 2),
        ("nnodes", 2),
        ("n_gpus_per_node", 1),
        ("placement", "split"),
        ("ray_address", "auto"),
    ):
        # ignored before (issue 24)
        with pytest.raises(ConfigError, match=rf"trainer.{key}={value} needs trainer.backend=ray"):
            load_config(None, [f"trainer.{key}={value}"])
    gpus = [*ray, "trainer.n_gpus_per_node=2"]
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=2 with trainer.placement=colocate on GPUs"):
        load_config(None, [*gpus, "rollout.vllm.tensor_parallel_size=2"])
    with pytest.raises(
        ConfigError,
        match=r"replicas=3 with trainer.placement=colocate on GPUs: at most one replica per worker GPU \(2\)",
    ):
        load_config(None, [*gpus, "rollout.vllm.replicas=3"])
    with pytest.raises(ConfigError, match="rollout.vllm.sync_bucket_mib"):
        load_config(None, [*ray, "rollout.vllm.sync_bucket_mib=0"])
    # on CPUs replicas may outnumber workers
    assert load_config(None, [*ray, "rollout.vllm.replicas=4"]).rollout.vllm.replicas == 4


@pytest.fixture(scope="module")
def cluster():
    import os
    import tempfile

    ray = pytest.importorskip("ray")
    os.environ["RAY_AUTH_MODE"] = "disabled"
    ray.init(
        num_cpus=3,
        include_dashboard=False,
        log_to_driver=False,
        _temp_dir=tempfile.mkdtemp(prefix="tether-ray-", dir="/tmp"),
    )
    yield ray
    ray.shutdown()


@pytest.mark.slow
# the plain model's path: tests/vllm/test_ray_vllm.py, with a real vLLM
@pytest.mark.parametrize("lora", [True], ids=["lora"])
def test_stream_weights_from_two_fsdp2_ranks(cluster, lora):
    """Two FSDP2 ranks (gloo, Ray actors) stream the embedded model with LoRA adapters (nonzero B)
    to two stand-in replicas in buckets of 16 KiB: each receives the merged HF-named weights of the
    driver's unsharded peft model, in order, to float32 rounding, each block whole in one bucket."""
    from tether.distributed.ray_backend import WorkerGroup
    from tether.rollout.vllm import iter_hf_named_weights

    ray = cluster

    class _Receiver:
        """Stands in for an EngineReplica (no vLLM here): keeps every bucket it is sent (defined here so
        Ray pickles it by value: the test module is not importable in Ray's workers)."""

        def __init__(self):
            self.buckets, self.syncs = [], 0

        def begin_sync(self):
            self.buckets = []

        def push(self, bucket):
            self.buckets.append(bucket)
            return len(bucket)

        def end_sync(self):
            self.syncs += 1
            return "stand-in"

        def received(self):
            return self.buckets

    extra = ["actor.lora.rank=4"] if lora else []
    cfg = load_config(None, ["trainer.backend=ray", "trainer.n_workers=2", "trainer.threads=1", *extra])
    model, lora_state = _tiny_lm(), None
    if lora:
        from peft import get_peft_model_state_dict

        from tether.models import apply_lora

        model = apply_lora(model, cfg.actor.lora)
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        lora_state = {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}
    want = list(iter_hf_named_weights(model))
    group = WorkerGroup("actor+ref", cfg, 2, ("actor",), lora_state)
    receivers = [ray.remote(_Receiver).remote() for _ in range(2)]
    try:
        stats = group.call("push_weights", receivers, 16 * 2**10)
        for r in receivers:
            buckets = ray.get(r.received.remote())
            got = [pair for b in buckets for pair in b]
            assert [n for n, _ in got] == [n for n, _ in want]
            for (name, a), (_, b) in zip(got, want, strict=True):
                assert torch.allclose(a, b, atol=1e-6 if lora else 0, rtol=0), name
            blocks = [{int(n.split(".layers.")[1].split(".")[0]) for n, _ in b if ".layers." in n} for b in buckets]
            for i in {i for s in blocks for i in s}:
                assert sum(i in s for s in blocks) == 1, f"block {i} split across buckets"
        assert stats["path"] == "stand-in" and stats["tensors"] == len(want) and stats["buckets"] == len(buckets) > 2
        assert stats["bytes"] == sum(t.numel() * t.element_size() for _, t in want)
    finally:
        group.kill()
