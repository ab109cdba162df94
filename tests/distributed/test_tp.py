"""Tensor parallelism (gloo, spawned processes) equals one process.

* The vocabulary-parallel log-softmax, entropy and exact KL on (B, T, V / tp) shards equal
  tether.algos' full-vocabulary ones, values and gradients (V = 15: uneven shards 8 + 7, one -inf logit).
* A tiny Qwen2 (4 query heads, 2 KV heads, tied embeddings) under tp = 2: logits, log-probs, entropy
  and exact KL equal the unsplit model's.

Training under tp > 1 (PPO updates, DCP resume across meshes) is in test_tp_train.py, through Ray
in test_ray.py.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tether.config import ConfigError, load_config
from tether.distributed import ParallelDims
from tether.testing import free_port


# ---------------------------------------------------------------------- degrees, checked in one place (no process
# group)
def test_parallel_dims_degrees():
    d = ParallelDims.from_world(8, tp=4)
    assert (d.dp_shard, d.tp) == (2, 4)
    assert [(d.dp_rank(r), d.tp_rank(r)) for r in (0, 3, 4, 7)] == [(0, 0), (0, 3), (1, 0), (1, 3)]
    with pytest.raises(ValueError, match="tp_size=3 must divide the worker group's world size 4"):
        ParallelDims.from_world(4, tp=3)
    with pytest.raises(ValueError, match="dp_shard=2 x tp=2 must multiply to the world size 8"):
        ParallelDims(dp_shard=2, world_size=8, tp=2)


def test_head_counts_must_divide_tp():
    from transformers import Qwen2Config

    ok = Qwen2Config(num_attention_heads=4, num_key_value_heads=2, hidden_size=32, vocab_size=15)
    ParallelDims.from_world(2, tp=2).check_model(ok)  # V = 15 need not divide: shards 8 + 7
    with pytest.raises(ConfigError, match=r"actor.tp_size=4 must divide the model's num_key_value_heads=2"):
        ParallelDims.from_world(4, tp=4).check_model(ok)
    bad = Qwen2Config(num_attention_heads=6, num_key_value_heads=3, hidden_size=48)
    with pytest.raises(ConfigError, match=r"num_attention_heads=6, num_key_value_heads=3"):
        ParallelDims.from_world(4, tp=4).check_model(bad)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["actor.tp_size=2"], "actor.tp_size=2 needs trainer.backend=ray"),
        (
            ["actor.tp_size=3", "trainer.backend=ray", "trainer.n_workers=4"],
            "actor.tp_size=3 must divide the worker group's 4 ranks",
        ),
        (["actor.tp_size=2", "trainer.backend=ray", "trainer.n_workers=2", "actor.lora.rank=4"], "with LoRA"),
    ],
)
def test_tp_size_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_tp_size_config_accepts_a_dividing_degree():
    cfg = load_config(None, ["actor.tp_size=2", "trainer.backend=ray", "trainer.n_workers=4"])
    assert cfg.actor.tp_size == 2


# ---------------------------------------------------------------------- spawned ranks
def _init(rank: int, world: int, port: int) -> None:
    import os

    import torch.distributed as dist

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)


def _vocab_parallel_checks(out: dict) -> None:
    """Sharded vs full log-probs / entropy / KL, values and gradients, on random (B, T, V) logits."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from tether import algos
    from tether.models import vocab_parallel as vp

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    g = torch.Generator().manual_seed(0)
    B, T, V, tau = 3, 4, 15, 0.7
    z = torch.randn(B, T, V, generator=g, dtype=torch.float64) * 3
    z[0, 0, 3] = float("-inf")  # a token the policy cannot emit (0 · log 0 = 0)
    zr = z + torch.randn(B, T, V, generator=g, dtype=torch.float64)
    ids = torch.randint(0, V, (B, T), generator=g)
    ids[1, 2], ids[2, 3] = 7, 8  # the last id of shard 0 and the first of shard 1
    w = torch.randn(3, B, T, generator=g, dtype=torch.float64)  # a random loss over the three outputs

    def loss_of(lp, ent, kl):
        return (w[0] * lp + w[1] * ent + w[2] * kl).sum()

    full = z.clone().requires_grad_(True)
    full_r = zr.clone().requires_grad_(True)
    lp, ent = algos.logprobs_and_entropy_from_logits(full, ids, tau)
    kl = algos.kl_full(full, full_r, temperature=tau)
    loss_of(lp, ent, kl).backward()

    local = distribute_tensor(z, mesh, [Shard(2)]).to_local().clone().requires_grad_(True)
    local_r = distribute_tensor(zr, mesh, [Shard(2)]).to_local().clone().requires_grad_(True)
    sz = DTensor.from_local(local, mesh, [Shard(2)], run_check=False, shape=z.shape, stride=z.stride())
    szr = DTensor.from_local(local_r, mesh, [Shard(2)], run_check=False, shape=z.shape, stride=z.stride())
    assert vp.is_vocab_sharded(sz) and not vp.is_vocab_sharded(z)
    s_lp, s_ent = vp.logprobs_and_entropy(sz, ids, tau)
    s_kl = vp.kl_full(sz, szr, tau)
    loss_of(s_lp, s_ent, s_kl).backward()
    gathered = [torch.empty(0)] * 2
    import torch.distributed as dist

    dist.all_gather_object(gathered, (local.grad, local_r.grad))
    out["vocab"] = {
        "local_V": local.shape[-1],
        "values": [(s_lp - lp).abs().max().item(), (s_ent - ent).abs().max().item(), (s_kl - kl).abs().max().item()],
        "grad": (torch.cat([gathered[0][0], gathered[1][0]], -1) - full.grad).abs().max().item(),
        "grad_ref": (torch.cat([gathered[0][1], gathered[1][1]], -1) - full_r.grad).abs().max().item(),
        "grad_scale": full.grad.abs().max().item(),
    }


def _qwen2_checks(out: dict) -> None:
    """A tiny Qwen2 split tp = 2 (dp = 1) against the same model unsplit."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tether.distributed.parallel import FSDPSettings, parallelize
    from tether.models import response_logprobs
    from tether.models.vocab_parallel import kl_full

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=30,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        max_position_embeddings=64,
    )
    model = Qwen2ForCausalLM(cfg).eval()
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * torch.randn_like(p))
    ids = torch.randint(0, 30, (3, 10), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # a left-padded prompt
    with torch.no_grad():
        lp, ent, lg = response_logprobs(model, ids, mask, 5, with_entropy=True, return_logits=True)
        rlg = response_logprobs(ref, ids, mask, 5, return_logits=True)[2]
        kl = kl_full(lg, rlg)
    dims = ParallelDims.from_world(2, tp=2)
    mesh = dims.build_mesh("cpu")
    tp_model = parallelize(copy.deepcopy(model), dims, FSDPSettings(), mesh=mesh)
    tp_ref = parallelize(copy.deepcopy(ref), dims, FSDPSettings(), mesh=mesh)
    with torch.no_grad():
        s_lp, s_ent, s_lg = response_logprobs(tp_model, ids, mask, 5, with_entropy=True, return_logits=True)
        s_rlg = response_logprobs(tp_ref, ids, mask, 5, return_logits=True)[2]
        s_kl = kl_full(s_lg, s_rlg)
    out["qwen2"] = {
        "local_logits": tuple(s_lg.to_local().shape),
        "tied": tp_model.lm_head.weight is tp_model.model.embed_tokens.weight,
        "q_proj_local": tuple(tp_model.model.layers[0].self_attn.q_proj.weight.to_local().shape),
        "logits": (s_lg.full_tensor() - lg).abs().max().item(),
        "logprobs": (s_lp - lp).abs().max().item(),
        "entropy": (s_ent - ent).abs().max().item(),
        "kl": (s_kl - kl).abs().max().item(),
        "kl_scale": kl.abs().max().item(),
    }


def _rank_main(rank: int, world: int, port: int, out_path: str) -> None:
    import torch.distributed as dist

    _init(rank, world, port)
    out: dict = {}
    _vocab_parallel_checks(out)
    _qwen2_checks(out)
    if rank == 0:
        torch.save(out, out_path)
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    path = tmp_path_factory.mktemp("tp") / "tp2.pt"
    torch.multiprocessing.spawn(_rank_main, args=(2, free_port(), str(path)), nprocs=2, join=True)
    return None, {"tp2": torch.load(path, weights_only=False)}


@pytest.mark.slow
def test_vocab_parallel_log_softmax_equals_full(runs):
    v = runs[1]["tp2"]["vocab"]
    assert v["local_V"] == 8  # rank 0 of tp = 2 over V = 15
    assert max(v["values"]) < 1e-5  # fp32 math (as tether.algos on fp32 logits): measured <= 9e-7
    assert v["grad"] < 1e-5 and v["grad_ref"] < 1e-5 and v["grad_scale"] > 0.1


@pytest.mark.slow
def test_qwen2_tp2_forward_equals_one_process(runs):
    q = runs[1]["tp2"]["qwen2"]
    assert q["local_logits"] == (3, 5, 15) and q["tied"] and q["q_proj_local"] == (16, 32)  # 2 of 4 heads of size 8
    assert q["logits"] < 1e-5 and q["logprobs"] < 1e-5 and q["entropy"] < 1e-5
    assert q["kl"] < 1e-5 and q["kl_scale"] > 1e-3
