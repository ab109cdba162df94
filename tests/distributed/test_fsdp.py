"""FSDP2 at world size 2 (gloo, spawned processes) equals one process on the same global batches.

A local Trainer runs 3 steps of the embedded task and records every batch its actor and critic
update on; two spawned ranks (RankWorker: the same ActorWorker/CriticWorker, FSDP2-sharded, with
the data-parallel hooks) replay those batches. Log-probs, values, every update metric and the final
weights must match the single process up to float32 rounding (tests/error_model.py): the gradient all-reduce and
the shards' micro-batches sum in another order than one process does, so the equality is not bitwise.
"""

from __future__ import annotations

import copy

import pytest
import torch
from error_model import AdamTrace, reduction_tol, update_terms

from tether.distributed import gather_rows, split_batch
from tether.testing import free_port
from tether.trainer.trainer import Trainer

pytestmark = [pytest.mark.slow, pytest.mark.kernels]

SMALL = [
    "trainer.total_steps=3",
    "trainer.progress=false",
    "trainer.threads=1",
    "data.batch_size=4",
    "data.embedded_train_size=8",
    "data.embedded_val_size=4",
    "rollout.n=4",
    "actor.share_prompt_prefix=false",
]  # world size 2 runs the ordinary pass (no sharing at ws > 1): so does ws 1
AGG_MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
VARIANTS = {  # name -> extra overrides; micro_batch_size 3 makes uneven micro-batches and padding rows
    **{f"grpo-{m}": [f"algo.loss_agg_mode={m}"] for m in AGG_MODES},
    "kl-loss": [
        "kl.placement=both",
        "kl.loss_estimator=k3",
        "algo.entropy_coef=0.01",
        "kl.loss_agg_mode=seq-mean-token-mean",
    ],
    "gae": ["algo.adv_estimator=gae", "critic.micro_batch_size=3"],
    "lora": ["actor.lora.rank=4"],
    "epochs": ["algo.ppo_epochs=2", "algo.mini_batch_size=8"],
    "ac-offload": ["trainer.fsdp.activation_checkpointing=true", "trainer.fsdp.cpu_offload=true"],
    "bf16": ["trainer.fsdp.param_dtype=bfloat16"],  # compute in bf16, fp32 master weights and AdamW moments
    "autocast": ["actor.compute_dtype=bfloat16"],  # torch.autocast to bf16 on both sides, fp32 LM heads
    "full-kl": ["kl.estimator=full"],
    # a sequence-level policy loss (per-response ratio, seq-mean-token-mean), off-policy over two mini-batches
    "gspo": ["algo.policy_loss=gspo", "algo.mini_batch_size=8"],
    # padding-free forwards and token-budget micro-batches for actor, reference and critic; every rank also runs
    # one extra empty micro-batch per pass (see _rank_main), which must change nothing
    "packed": [
        "algo.adv_estimator=gae",
        "actor.padding_free=true",
        "actor.max_tokens_per_micro_batch=20",
        "critic.padding_free=true",
        "critic.max_tokens_per_micro_batch=20",
        "kl.placement=both",
        "kl.loss_estimator=k3",
        "algo.entropy_coef=0.01",
    ],
}


def _record(cfg) -> dict:
    """Run 3 local steps; return the batches each update saw, the update metrics and the final weights."""
    trainer = Trainer(cfg)
    actor, critic = trainer.roles.actor, trainer.roles.critic
    rec = {"cfg": cfg, "steps": [], "lora": None}
    if cfg.actor.lora.rank:
        from peft import get_peft_model_state_dict

        rec["lora"] = {k: v.clone() for k, v in get_peft_model_state_dict(actor.model).items()}
    step_rec: dict = {}
    orig_actor, orig_critic = actor.update, critic.update if critic is not None else None

    def actor_update(batch, spec, step, ref=None):
        step_rec.update(batch=copy.deepcopy(batch), spec=spec, step=step)
        step_rec["actor"] = out = orig_actor(batch, spec, step, ref=ref)
        rec["steps"].append(dict(step_rec))
        return out

    def critic_update(batch, **kw):
        step_rec["critic_kw"] = kw
        step_rec["critic"] = out = orig_critic(batch, **kw)
        return out

    actor.update = actor_update
    if critic is not None:
        critic.update = critic_update
    # each optimizer step's gradient RMS: the error model of the final weights (AdamTrace)
    traces = {"actor": AdamTrace(actor.optimizer, actor.model)}
    if critic is not None:
        traces["critic"] = AdamTrace(critic.optimizer, critic.model)
    for _ in range(3):
        trainer.train_step()
    rec["traces"] = {role: t.close() for role, t in traces.items()}
    rec["n_terms"] = max(update_terms(s["batch"], actor.model.config) for s in rec["steps"])
    rec["actor_final"] = {n: p.detach().clone() for n, p in actor.model.named_parameters() if p.requires_grad}
    if critic is not None:
        rec["critic_final"] = {n: p.detach().clone() for n, p in critic.model.named_parameters()}
    return rec


def _rank_main(rank: int, world: int, port: int, recs: dict, out_path: str) -> None:
    import torch.distributed as dist

    from tether.distributed.worker import RankWorker

    torch.set_num_threads(1)
    results = {}
    for name, rec in recs.items():
        cfg = rec["cfg"]
        roles = ("actor", "critic") if cfg.algo.adv_estimator == "gae" else ("actor",)
        w = RankWorker(cfg, rank, world, "127.0.0.1", port, roles=roles, lora_state=rec["lora"])
        if name == "packed":  # the same extra count on every rank: empty micro-batches under FSDP2
            w.dp.micro_batch_count = lambda n, count=w.dp.micro_batch_count: count(n) + 1
        res = {"steps": []}
        for s in rec["steps"]:
            batch = s["batch"]
            shards, parts = split_batch(batch, world)
            lp = w.compute_logprobs(shards[rank], with_entropy=True, full_kl=cfg.kl.estimator == "full")
            ref = w.ref_logprobs(shards[rank])
            vals = w.compute_values(shards[rank]) if w.critic is not None else None
            got = [None] * world
            dist.all_gather_object(got, (lp, ref, vals))
            step_res = {
                "old_logprobs": gather_rows([g[0][0] for g in got], parts),
                "ref_logprobs": gather_rows([g[1] for g in got], parts),
            }
            if vals is not None:
                step_res["values"] = gather_rows([g[2] for g in got], parts)
                step_res["critic"] = w.update_critic(batch, s["critic_kw"])
            step_res["actor"] = w.update_actor(batch, s["spec"], s["step"])
            res["steps"].append(step_res)
        opt_state = w.actor.optimizer.state
        res["dtypes"] = {
            "param": {str(p.dtype) for p in w.actor.model.parameters()},
            "adam": {
                str(v.dtype) for st in opt_state.values() for k, v in st.items() if k in ("exp_avg", "exp_avg_sq")
            },
            "sharded": all(type(p).__name__ == "DTensor" for p in w.actor.model.parameters()),
        }
        res["actor_final"] = w.full_state("actor")
        if w.critic is not None:
            res["critic_final"] = w.full_state("critic")
        if name == "epochs":  # one NaN advantage: only the rank holding that row sees a non-finite loss
            bad = copy.deepcopy(rec["steps"][-1]["batch"])
            bad.advantages[0, 0] = float("nan")
            res["nonfinite"] = w.update_actor(bad, rec["steps"][-1]["spec"], 99)  # finishes: no rank waits
        results[name] = res
    if rank == 0:
        torch.save(results, out_path)
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def replay(tmp_path_factory):
    from tether.config import load_config

    root = tmp_path_factory.mktemp("fsdp")
    recs = {}
    for name, extra in VARIANTS.items():
        cfg = load_config(
            None,
            [
                *SMALL,
                "trainer.val_freq=0",
                "trainer.save_freq=0",
                "trainer.report=false",
                "trainer.loggers=[jsonl]",
                "actor.micro_batch_size=3",
                "guard.target_kl=null",
                f"trainer.output_dir={root / name}",
                *extra,
            ],
        )
        recs[name] = _record(cfg)
    out = root / "ws2.pt"
    replays = {name: {k: v for k, v in rec.items() if k != "traces"} for name, rec in recs.items()}
    torch.multiprocessing.spawn(_rank_main, args=(2, free_port(), replays, str(out)), nprocs=2, join=True)
    return recs, torch.load(out, weights_only=False)


@pytest.mark.parametrize("name", [v for v in VARIANTS if v not in ("bf16", "autocast")])
def test_world_size_2_equals_1(replay, name):
    """Error model (tests/error_model.py). Per step, log-probs, values and update metrics: float32 reductions over
    n = 16 rows × 10 positions + 256 (the MLP's width) = 416 O(1) terms, so rel = abs = n·u = 2.5e-5 (measured under
    SSE4.2, AVX2 and AVX-512 kernels: at most 0.35 of it). Final weights after 3 AdamW steps: AdamTrace's bound per
    element, ~5% of lr for the median element, up to 2·lr for the 7% whose gradient is within n·u of zero, where the
    two sums' orders may flip AdamW's normalized step (measured: at most 0.14 of the bound; 5.9e-6 = 0.02·lr at most).
    One row's advantages zeroed in the replay puts 67% of the elements past it."""
    recs, results = replay
    rec, res = recs[name], results[name]
    tol = reduction_tol(rec["n_terms"])
    assert res["dtypes"] == {"param": {"torch.float32"}, "adam": {"torch.float32"}, "sharded": True}
    assert len(res["steps"]) == 3
    for s, (want, got) in enumerate(zip(rec["steps"], res["steps"], strict=True)):
        batch = want["batch"]
        mask = batch.response_mask.bool()
        assert torch.allclose(got["old_logprobs"][mask], batch.old_logprobs[mask], atol=tol, rtol=tol), (name, s)
        assert torch.allclose(got["ref_logprobs"][mask], batch.ref_logprobs[mask], atol=tol, rtol=tol), (name, s)
        if "values" in got:
            assert torch.allclose(got["values"][mask], batch.values[mask], atol=tol, rtol=tol), (name, s)
        for role in ("actor", "critic"):
            if role in want:
                assert set(got[role]) == set(want[role]), (name, s, role)
                for k, v in want[role].items():
                    assert got[role][k] == pytest.approx(v, abs=tol, rel=tol), (name, s, role, k)
        a = rec["cfg"].algo  # 16 responses: one mini-batch (or two of 8 per epoch), every one applied
        assert want["actor"]["policy/updates"] == a.ppo_epochs * -(-16 // a.mini_batch_size)
    for role in ("actor", "critic"):
        if f"{role}_final" in rec:
            rec["traces"][role].check(res[f"{role}_final"], rec[f"{role}_final"], rec["n_terms"], what=(name, role))


def test_nonfinite_loss_on_one_rank_drops_the_mini_batch_everywhere(replay):
    """Row 0's NaN advantage makes one rank's loss NaN in the one mini-batch (per epoch) holding it: every rank
    skips that mini-batch, and guard.atomic_update then undoes the two applied ones on every rank, each its own
    shards (2 epochs x 2 mini-batches of 8: 4 not applied, 2 of them undone)."""
    _, results = replay
    m = results["epochs"]["nonfinite"]
    assert m["guard/nonfinite_skip"] == 4.0 and m["policy/updates"] == 0.0 and m["guard/undone_updates"] == 2.0


def test_autocast_compute_dtype_reaches_the_workers(replay):
    """actor.compute_dtype=bfloat16 on both sides: bf16 matmuls whose rounding depends on the
    micro-batch shapes, so the two layouts agree to bf16 precision (not 1e-5), and train alike."""
    recs, results = replay
    rec, res = recs["autocast"], results["autocast"]
    for want, got in zip(rec["steps"], res["steps"], strict=True):
        mask = want["batch"].response_mask.bool()
        assert float((got["old_logprobs"][mask] - want["batch"].old_logprobs[mask]).abs().max()) < 0.05
        assert got["actor"]["policy/loss"] == pytest.approx(want["actor"]["policy/loss"], abs=0.02)
    assert res["dtypes"]["param"] == {"torch.float32"}


def test_bf16_compute_keeps_fp32_master_weights(replay):
    """trainer.fsdp.param_dtype=bfloat16: forward/backward in bf16 (log-probs off by bf16 rounding,
    ~1e-2 nats, not 1e-5), while the sharded parameters and AdamW's moments stay float32."""
    recs, results = replay
    rec, res = recs["bf16"], results["bf16"]
    assert res["dtypes"] == {"param": {"torch.float32"}, "adam": {"torch.float32"}, "sharded": True}
    batch = rec["steps"][0]["batch"]
    mask = batch.response_mask.bool()
    err = (res["steps"][0]["old_logprobs"][mask] - batch.old_logprobs[mask]).abs().max()
    assert 1e-5 < float(err) < 0.2  # bf16 really computes, and still computes the same function
    assert all(v.dtype == torch.float32 for v in res["actor_final"].values())
