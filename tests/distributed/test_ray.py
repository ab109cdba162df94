"""trainer.backend=ray against a real local Ray cluster (one per module: ray.init takes ~10 s)."""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path

import pytest
from distill_teachers import sharpened_teacher
from error_model import check_final_weights, reduction_tol, trace_updates

ray = pytest.importorskip("ray")

from tether.config import ConfigError, load_config  # noqa: E402
from tether.trainer.trainer import Trainer  # noqa: E402

pytestmark = pytest.mark.slow

SMALL = [
    "trainer.total_steps=3",
    "trainer.progress=false",
    "trainer.val_freq=2",
    "trainer.save_freq=2",
    "trainer.threads=1",
    "data.batch_size=4",
    "data.embedded_train_size=8",
    "data.embedded_val_size=4",
    "rollout.n=4",
    "trainer.val_n=2",
    "algo.mini_batch_size=8",
    "actor.micro_batch_size=3",
    "trainer.report=false",
    "trainer.loggers=[jsonl]",
    # worker groups of 2 ranks run the ordinary pass (actor.share_prompt_prefix falls back there), so the local run it
    # is
    # compared with does too: the shared pass equals it only to round-off, which Adam's first steps amplify past 1e-5
    "actor.share_prompt_prefix=false",
]
NOT_COMPARED = ("timing/", "perf/")


@pytest.fixture(scope="module")
def cluster():
    """One local Ray for the module, with auth off and its files under the project's TMPDIR."""
    tmp = Path(os.environ.get("TMPDIR", Path(__file__).parents[2] / ".tmp"))
    tmp.mkdir(parents=True, exist_ok=True)
    os.environ["RAY_AUTH_MODE"] = "disabled"
    os.environ["TMPDIR"] = str(tmp)
    ray_dir = tmp / "ray"
    if len(str(ray_dir)) > 48:  # Ray's unix sockets live under it, and a socket path may not pass 107 bytes
        ray_dir = Path(tempfile.mkdtemp(prefix="tether-ray-", dir="/tmp"))
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, _temp_dir=str(ray_dir))
    yield
    ray.shutdown()


def _cfg(out, *extra):
    return load_config(None, [*SMALL, f"trainer.output_dir={out}", *extra])


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _compare(a: list[dict], b: list[dict], tol: float = 1e-5) -> None:
    """Every non-timing metric of two runs' metrics.jsonl within ``tol`` (absolute or relative)."""
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b, strict=True):
        keys = {k for k in ra if not k.startswith(NOT_COMPARED)}
        assert keys == {k for k in rb if not k.startswith(NOT_COMPARED)}, ra["step"]
        for k in keys:
            va, vb = ra[k], rb[k]
            # NaN is written as null (policy/entropy unmeasured)
            if va is None or (isinstance(va, float) and math.isnan(va)):
                assert vb is None or math.isnan(vb), (ra["step"], k)
            else:
                assert vb == pytest.approx(va, abs=tol, rel=tol), (ra["step"], k, va, vb)


EQUAL_CASES = {
    "grpo": [],
    # no validation: the driver then holds neither a reference nor a critic model, only the policy
    "gae-split-ref-reset": [
        "algo.adv_estimator=gae",
        "trainer.placement=split",
        "ref.reset_every=2",
        "trainer.val_freq=0",
    ],
    "lora-gspo": ["actor.lora.rank=4", "algo.policy_loss=gspo"],  # and a sequence-level policy loss on the ranks
    "full-kl-ref-reset": ["kl.estimator=full", "ref.reset_every=2"],
    # the driver generates batches (and their behaviour log-probs) while the workers train: three batches ahead, each
    # weighed against the mismatched engine (TIS), with a rejection that takes responses out
    # of the all-reduced loss counts, and an off-policy-corrected k3 KL loss over two mini-batches; the (B, T) token
    # masks and α of the entropy controls and mask_truncated travel to the ranks with the batch and the spec.
    # The KL is in the loss only (kl.placement=loss): the batches of steps 1-3 are sampled from θ_0 = the reference,
    # so a reward −β·KL is exactly 0 locally (behaviour and reference log-probs from equal passes) but rounding on
    # Ray (the behaviour log-probs from the driver, the reference's from the FSDP ranks: up to 1.7e-6 nats), and a
    # group whose 4 scores tie then gets advantages of pure rounding: divided by its std + 1e-6 they reached 0.009
    # (kl_loss 2.4% apart at step 1), undivided (algo.norm_by_std=none) they still flip policy/clipfrac, which counts
    # a token whose advantage is 1e-8 rather than 0. An ill-conditioned tie, not a path difference.
    "async-3-rollout-correction": [
        "rollout.async_steps=3",
        "rollout.engine_temperature=1.5",
        "algo.rollout_correction.level=token",
        "algo.rollout_correction.reject=seq_mean_k3",
        "algo.rollout_correction.reject_threshold=0.05",
        "kl.placement=loss",
        "kl.loss_estimator=k3",
        "algo.mini_batch_size=8",
        "algo.top_entropy_quantile=0.5",
        "algo.mask_truncated=true",
        "algo.entropy_target=2.5",
        "algo.entropy_coef=0.01",
    ],
    # padding-free forwards and token-budget micro-batches (ranks pad to equal micro-batch counts)
    "packed": [
        "algo.adv_estimator=gae",
        "actor.padding_free=true",
        "actor.max_tokens_per_micro_batch=20",
        "critic.padding_free=true",
        "critic.max_tokens_per_micro_batch=20",
    ],
}


#: keys of the Ray backend only, left out of the local run it is compared with
RAY_ONLY = ("trainer.placement=",)


@pytest.mark.kernels
@pytest.mark.parametrize("extra", list(EQUAL_CASES.values()), ids=list(EQUAL_CASES))
def test_ray_world_size_2_equals_local(cluster, tmp_path, extra):
    """Three steps of the embedded task: every non-timing metric (validation and exact/* included)
    of trainer.backend=ray with 2 FSDP2 workers against the local backend's, and the driver's copy of the
    final weights. HF rollouts generate on that copy, so it takes the workers' weights after each of the 3
    updates and after a guard rollback's load (RemoteActor eager: 3 pulls + one per rollback; grpo rolls back
    at step 3). Error model (tests/error_model.py): the metrics are float32 reductions over n = 16 rows × ~10
    positions + 256 ≈ 416 O(1) terms, compared at n·u ≈ 2.5e-5; the weights at AdamTrace's bound (as in
    test_fsdp). Over 3 steps the samples could in principle part (a token drawn from weights that differ by
    rounding); none has here under any kernel setting of make test-kernels."""
    # the local backend refuses Ray's keys
    local = Trainer(_cfg(tmp_path / "local", *(e for e in extra if not e.startswith(RAY_ONLY))))
    trace, terms = trace_updates(local)
    local.fit()
    remote = Trainer(_cfg(tmp_path / "ray", "trainer.backend=ray", "trainer.n_workers=2", *extra))
    remote.fit()
    _compare(_metrics(tmp_path / "local"), _metrics(tmp_path / "ray"), tol=reduction_tol(max(terms)))
    check_final_weights(local, remote, trace, terms)
    assert (
        not remote.roles.actor.lazy
        and remote.roles.actor.pulls == 3 + _metrics(tmp_path / "ray")[-1]["guard/rollbacks"]
    )
    assert remote.roles.placement.groups == [] and ray.is_initialized()  # its groups are gone; the module's Ray is not
    if "trainer.val_freq=0" in extra:
        assert remote.roles.ref.local is None and not hasattr(remote.roles.critic, "model")


DISTILL_CASES = {
    "k1": [],
    # the teacher's logits in the ranks' old-logprob pass and in every micro-batch of the update (the loss term)
    "jsd": ["distill.estimator=jsd", "distill.jsd_beta=0.3"],
}


@pytest.mark.kernels
@pytest.mark.parametrize("extra", list(DISTILL_CASES.values()), ids=list(DISTILL_CASES))
def test_ray_distillation_equals_local(cluster, tmp_path, extra):
    """distill.teacher=DIR on trainer.backend=ray, world size 2: the teacher is sharded on the actor group's ranks as
    the reference is, its log-probs (k1) or logits (jsd, in the actor's own passes) split over the ranks and gathered
    in the batch's order. Three steps give every non-timing metric of the local run, distill/* included, and the same
    final weights, under the error model of test_ray_world_size_2_equals_local (a reduction of ~416 terms; the
    weights at AdamTrace's bound)."""
    teacher = sharpened_teacher(tmp_path / "teacher", factor=2.0)
    extra = [f"distill.teacher={teacher}", "distill.coef=0.5", *extra]
    local = Trainer(_cfg(tmp_path / "local", *extra))
    trace, terms = trace_updates(local)
    local.fit()
    remote = Trainer(_cfg(tmp_path / "ray", "trainer.backend=ray", "trainer.n_workers=2", *extra))
    assert remote.roles.teacher.group is remote.roles.placement.actor_group  # not a driver copy
    remote.fit()
    want, got = _metrics(tmp_path / "local"), _metrics(tmp_path / "ray")
    assert all(r["distill/kl_student_teacher_seq"] > 0.1 for r in want if r["step"] > 0)  # the teacher is not π
    _compare(want, got, tol=reduction_tol(max(terms)))
    check_final_weights(local, remote, trace, terms)


AGENT_CASES = {
    "kl-in-reward": [],
    # the k3 KL in the loss, with the KL to go of the later turns' model tokens (tether.algos.kl_to_go_term)
    "kl-in-loss-to-go": ["kl.placement=loss", "kl.loss_estimator=k3", "kl.loss_to_go=true"],
    # the critic on the ranks: its value loss and its token counts run over the model's tokens (action_mask)
    "gae": ["algo.adv_estimator=gae"],
}


@pytest.mark.kernels
@pytest.mark.parametrize("extra", list(AGENT_CASES.values()), ids=list(AGENT_CASES))
def test_ray_agent_equals_local(cluster, tmp_path, extra):
    """The multi-turn loop on trainer.backend=ray, world size 2 (data.embedded_task=digitsum_tool: the AgentRunner runs
    on the driver; turn rewards, KL in the reward and returns are the driver's; the ranks get each batch with its
    loss_mask and generated_mask, and kl.loss_to_go in the spec): three steps give every non-timing metric of the
    local run, agent/* included, and the same final weights. The observation tokens (the tool's output) stay out of
    the ranks' losses and counts as locally: a rank without loss_mask (the actor's update_mask) parts at step 1, one
    without generated_mask (the critic's action_mask) in the gae case, one without kl.loss_to_go in the to-go case.
    No validation (it enumerates the task's ~744k trajectories per prompt). Error model of
    test_ray_world_size_2_equals_local: metrics at n·u, weights at AdamTrace's bound."""
    extra = ["data.embedded_task=digitsum_tool", "trainer.val_freq=0", *extra]
    local = Trainer(_cfg(tmp_path / "local", *extra))
    trace, terms = trace_updates(local)
    local.fit()
    remote = Trainer(_cfg(tmp_path / "ray", "trainer.backend=ray", "trainer.n_workers=2", *extra))
    remote.fit()
    want, got = _metrics(tmp_path / "local"), _metrics(tmp_path / "ray")
    steps = [r for r in want if r["step"] > 0]
    # the loop ran: tool calls made second turns, whose observation tokens are a share of the responses
    assert all(r["agent/tool_calls"] > 0 and 0.0 < r["agent/observation_frac"] < 1.0 for r in steps)
    _compare(want, got, tol=reduction_tol(max(terms)))
    check_final_weights(local, remote, trace, terms)


#: one epoch, one mini-batch of all 16 responses, KL in the loss: the update's own forward gives old_logprobs
REUSE = ["algo.mini_batch_size=16", "kl.placement=loss", "kl.estimator=k3", "kl.coef=0.05"]


@pytest.mark.kernels
@pytest.mark.parametrize(
    "packing", [[], ["actor.padding_free=true", "actor.max_tokens_per_micro_batch=20"]], ids=["padded", "packed"]
)
def test_ray_reuses_update_logprobs_like_local(cluster, tmp_path, packing):
    """actor.reuse_update_logprobs under trainer.backend=ray: each rank's update measures the old
    log-probs and entropy of its own rows (micro-batches of 3, so the shards are padded), the driver
    gets them back in the batch's order, and every non-timing metric (kl/*, policy/entropy,
    exact/*) equals the local run's, which reuses them too; neither runs the actor's no-grad pass. Error model as
    in test_ray_world_size_2_equals_local: metrics at n·u, final weights at AdamTrace's bound."""
    runs = {}
    for name, extra in {"local": [], "ray": ["trainer.backend=ray", "trainer.n_workers=2"]}.items():
        t = Trainer(_cfg(tmp_path / name, *REUSE, *packing, *extra))
        calls = []
        orig = t.roles.actor.compute_logprobs
        t.roles.actor.compute_logprobs = lambda *a, _orig=orig, _calls=calls, **k: _calls.append(1) or _orig(*a, **k)
        if name == "local":
            trace, terms = trace_updates(t)
        t.fit()
        runs[name] = (t, calls)
    assert runs["local"][1] == [] and runs["ray"][1] == []  # the old log-probs came from the update on both
    local, ray_run = _metrics(tmp_path / "local"), _metrics(tmp_path / "ray")
    _compare(local, ray_run, tol=reduction_tol(max(terms)))
    steps = [r for r in ray_run if r["step"] > 0]
    assert all(r["policy/approx_kl"] == 0.0 and r["policy/entropy"] > 1.0 for r in steps)  # ratio exactly 1
    # step 1's policy is the reference: a row's log-probs put back at another row's place would show a KL
    assert steps[0]["kl/ref_mean"] < 1e-7 and all(r["kl/ref_mean"] > 1e-3 for r in steps[1:])
    check_final_weights(runs["local"][0], runs["ray"][0], trace, terms)


TP_CASES = {
    "old-logprob-pass": ["kl.placement=loss", "kl.loss_estimator=k3"],  # two mini-batches: a separate no-grad pass
    "reuse-update-logprobs": REUSE,  # the update's own forward gives them (DataParallel.merge_rows over dp only)
}


@pytest.mark.kernels
@pytest.mark.parametrize("extra", list(TP_CASES.values()), ids=list(TP_CASES))
def test_ray_tensor_parallel_equals_local(cluster, tmp_path, extra):
    """trainer.backend=ray trainer.n_workers=2 actor.tp_size=2 (one tp = 2 group, dp = 1, over the
    embedded model's 4 heads) with the k3 KL in the loss, the old log-probs from a separate pass or
    from the update: every non-timing metric of 3 steps (a validation and a sharded checkpoint at
    step 2 included) against the local backend's, and the driver's final weights. Error model as in
    test_ray_world_size_2_equals_local: metrics at n·u, final weights at AdamTrace's bound."""
    local = Trainer(_cfg(tmp_path / "local", *extra))
    trace, terms = trace_updates(local)
    local.fit()
    remote = Trainer(_cfg(tmp_path / "ray", "trainer.backend=ray", "trainer.n_workers=2", "actor.tp_size=2", *extra))
    remote.fit()
    a, b = _metrics(tmp_path / "local"), _metrics(tmp_path / "ray")
    _compare(a, b, tol=reduction_tol(max(terms)))
    assert b[-1]["actor/kl_loss"] > 1e-6  # the KL term is in the loss
    check_final_weights(local, remote, trace, terms)
    assert (tmp_path / "ray" / "checkpoints" / "step_000002").is_dir()


def test_killed_worker_names_the_role(cluster, tmp_path):
    """A worker killed mid-run: the next call fails naming the group and the rank; the step-1
    checkpoint loads on fresh workers (the very weights of step 1) and training goes on from it."""
    from tether.distributed.ray_backend import WorkerDiedError

    cfg = _cfg(tmp_path / "run", "trainer.backend=ray", "trainer.n_workers=2", "trainer.save_freq=1")
    trainer = Trainer(cfg)
    trainer.train_step()  # checkpoint step 1
    at_1 = _weights(trainer.roles.actor.model)
    ray.kill(trainer.roles.placement.actor_group.workers[1])
    with pytest.raises(
        WorkerDiedError,
        match=r"actor\+ref worker group: rank 1 died during compute_logprobs \(ActorDiedError: The actor is dead "
        r"because it was killed by `ray.kill`\.\)",
    ):
        trainer.train_step()
    trainer.roles.close()
    again = Trainer(cfg)  # the last checkpoint still loads, on fresh workers
    assert again.step == 1
    assert _max_diff(at_1, _weights(again.roles.actor.model)) == 0.0
    pulled = again.roles.placement.actor_group.call("full_state", "actor", True)
    assert _max_diff({k: at_1[k] for k in pulled}, pulled) == 0.0  # the workers hold them too
    assert again.train_step()["policy/updates"] > 0
    again.roles.close()


def test_an_actor_that_fails_to_start_is_named_with_its_error(cluster):
    """An actor whose __init__ raises: ray.get of its first call gives an ActorDiedError whose only
    trace of the cause is the remote traceback in its message (the actor's log does not reach the
    driver); death_cause gives the traceback's last line, the error itself."""
    from tether.distributed.ray_backend import death_cause

    class FailsToStart:  # defined here: pickled by value (the workers cannot import this test module)
        def __init__(self):
            raise ConfigError("rollout.vllm.tensor_parallel_size=3 on the CPU backend needs a core per tp rank")

        def ping(self):
            return "never"

    actor = ray.remote(FailsToStart).options(num_cpus=0).remote()
    with pytest.raises(ray.exceptions.RayActorError) as info:
        ray.get(actor.ping.remote())
    assert death_cause(info.value) == (
        "its __init__ raised tether.config.ConfigError: rollout.vllm.tensor_parallel_size=3 on the CPU backend needs a "
        "core per tp rank"
    )


def test_a_peers_error_after_a_rank_died_names_the_dead_rank(cluster):
    """Rank 1 dies in a collective and rank 0's call fails first (gloo: connection reset by peer):
    the message names rank 1 as the one that died, and rank 0's error as what followed."""
    import time as _time

    from tether.distributed.ray_backend import WorkerDiedError, WorkerGroup

    class Rank:
        def fail_soon(self):
            raise RuntimeError("[gloo] Read error: Connection reset by peer")

        def die_later(self):
            _time.sleep(0.5)
            os._exit(1)

    a, b = (ray.remote(Rank).options(num_cpus=0).remote() for _ in range(2))
    group = WorkerGroup.__new__(WorkerGroup)  # only its name and _get
    group.name = "actor+ref"
    with pytest.raises(WorkerDiedError) as info:
        group._get([a.fail_soon.remote(), b.die_later.remote()], "save_checkpoint")
    msg = str(info.value)
    assert msg.startswith("actor+ref worker group: rank 1 died during save_checkpoint (ActorDiedError: ")
    assert msg.endswith(
        "(then rank 0 failed in save_checkpoint: RuntimeError: [gloo] Read error: Connection reset by peer)"
    )
    with pytest.raises(WorkerDiedError, match=r"^actor\+ref worker group: rank 0 failed in step: RuntimeError"):
        group._get([a.fail_soon.remote()], "step")  # no peer died: the error itself
    ray.kill(a)


def test_gpus_asked_of_a_local_cpu_ray_are_refused_at_once(cluster, monkeypatch):
    """trainer.n_gpus_per_node on a machine without GPUs: the local Ray tether started cannot grow, so
    the run stops at once naming the key (its placement groups would time out after 120 s); an
    attached cluster, which an autoscaler may grow, is left to the placement groups' wait."""
    from tether.distributed.ray_backend import RayCluster

    local = RayCluster.__new__(RayCluster)  # as if it had started the module's Ray (0 GPUs)
    local.started = True
    closed = []
    monkeypatch.setattr(local, "close", lambda: closed.append(True))
    with pytest.raises(
        ConfigError, match=r"trainer.n_gpus_per_node=2, but the local Ray tether started finds 0 GPU\(s\)"
    ):
        local.check_gpus(2)
    assert closed == [True]  # the Ray it started is shut down before the error
    local.check_gpus(0)  # a CPU run asks for none
    local.started = False
    local.check_gpus(2)  # attached


def test_an_attached_ray_is_left_running(cluster):
    from tether.distributed.ray_backend import RayCluster

    attached = RayCluster(None, 1)  # this process already joined a Ray: use it
    assert not attached.started
    attached.close()
    assert ray.is_initialized()


def test_bad_degrees_fail_before_start(tmp_path):
    with pytest.raises(ConfigError, match="n_workers=3 must equal"):
        _cfg(tmp_path / "x", "trainer.backend=ray", "trainer.n_workers=3", "trainer.n_gpus_per_node=2")


def _weights(model) -> dict:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.fixture(scope="module")
def sharded_run(cluster, tmp_path_factory):
    """4 uninterrupted steps at world size 2, sharded checkpoints at steps 2 and 4."""
    root = tmp_path_factory.mktemp("sharded")
    t = Trainer(
        _cfg(root / "a", "trainer.backend=ray", "trainer.n_workers=2", "trainer.total_steps=4", "trainer.keep_last=3")
    )
    t.fit()
    return root, _metrics(root / "a"), _weights(t.roles.actor.model)


def test_sharded_checkpoint_layout_and_exact_resume(sharded_run, tmp_path):
    """Resume at the same world size from the step-2 checkpoint: steps 3-4 as in the uninterrupted run."""
    from tether.checkpoint import verify_checkpoint

    root, metrics, final = sharded_run
    ckpt = root / "a" / "checkpoints" / "step_000002"
    files = set(verify_checkpoint(ckpt)["files"])  # the manifest covers the shards
    assert {
        "dcp/.metadata",
        "dcp/__0_0.distcp",
        "dcp/__1_0.distcp",
        "dcp/schedulers.pt",
        "actor/config.json",
        "trainer_state.json",
    } <= files
    assert not any(f.endswith(".safetensors") for f in files) and "optim.pt" not in files  # no full copy
    t = Trainer(
        _cfg(
            tmp_path / "b",
            "trainer.backend=ray",
            "trainer.n_workers=2",
            "trainer.total_steps=4",
            f"trainer.resume={ckpt}",
        )
    )
    assert t.step == 2
    t.fit()
    _compare(metrics[-2:], _metrics(tmp_path / "b")[-2:], tol=1e-6)
    assert _max_diff(final, _weights(t.roles.actor.model)) < 1e-6


@pytest.mark.parametrize("n_from, n_to", [(2, 1), (1, 2)])
def test_resume_at_another_world_size(sharded_run, tmp_path, n_from, n_to):
    """A world-size-``n_from`` checkpoint resumed by ``n_to`` workers starts from exactly its weights
    and continues as the uninterrupted run does (to the 1e-5 of world size 1 vs 2)."""
    root, metrics, final = sharded_run
    if n_from == 2:
        ckpt = root / "a" / "checkpoints" / "step_000002"
    else:  # a world-size-1 run of 2 steps
        Trainer(_cfg(tmp_path / "ws1", "trainer.backend=ray", "trainer.n_workers=1", "trainer.total_steps=2")).fit()
        ckpt = tmp_path / "ws1" / "checkpoints" / "step_000002"
    t = Trainer(
        _cfg(
            tmp_path / "b",
            "trainer.backend=ray",
            f"trainer.n_workers={n_to}",
            "trainer.total_steps=4",
            f"trainer.resume={ckpt}",
        )
    )
    loaded = _weights(t.roles.actor.model)
    pulled = t.roles.placement.actor_group.call("full_state", "actor", True)
    assert _max_diff({k: loaded[k] for k in pulled}, pulled) == 0.0  # the driver copy is the workers' weights
    t.fit()
    _compare(metrics[-2:], _metrics(tmp_path / "b")[-2:], tol=1e-5)
    assert _max_diff(final, _weights(t.roles.actor.model)) < 1e-5


def test_export_from_sharded_checkpoint(sharded_run, tmp_path):
    from transformers import AutoModelForCausalLM

    from tether.export import export_checkpoint

    root, _, final = sharded_run
    out = export_checkpoint(root / "a" / "checkpoints" / "step_000004", tmp_path / "hf")
    model = AutoModelForCausalLM.from_pretrained(str(out))
    assert _max_diff(final, _weights(model)) == 0.0
    assert (out / "tokenizer_config.json").is_file()
    from tether.evaluation.evaluate import load_policy

    policy, _, run = load_policy(root / "a")  # tether eval on the run directory: the sharded step-4 checkpoint
    assert run == root / "a" and _max_diff(final, _weights(policy)) == 0.0


def test_backends_refuse_each_others_checkpoints(sharded_run, tmp_path):
    from tether.checkpoint import CheckpointError

    root, _, _ = sharded_run
    ckpt = root / "a" / "checkpoints" / "step_000002"
    with pytest.raises(CheckpointError, match="written by trainer.backend=ray"):
        Trainer(_cfg(tmp_path / "local", "trainer.total_steps=4", f"trainer.resume={ckpt}"))
    Trainer(_cfg(tmp_path / "l2", "trainer.total_steps=2")).fit()
    with pytest.raises(CheckpointError, match="written by trainer.backend=local"):
        Trainer(
            _cfg(
                tmp_path / "r",
                "trainer.backend=ray",
                "trainer.total_steps=4",
                f"trainer.resume={tmp_path / 'l2' / 'checkpoints' / 'step_000002'}",
            )
        )


def test_cli_sigkill_of_the_driver_then_resume(cluster, tmp_path, sharded_run):
    """`tether train trainer.backend=ray` attached to a running cluster (trainer.ray_address), killed
    while writing its step-4 checkpoint: re-running the command resumes from step 2 and ends with the
    uninterrupted run's metrics; the cluster it attached to is still up."""
    import subprocess
    import sys

    from tether.checkpoint import FAULT_ENV

    _, metrics, _ = sharded_run
    address = ray.get_runtime_context().gcs_address
    args = [
        *SMALL,
        "trainer.backend=ray",
        "trainer.n_workers=2",
        "trainer.total_steps=4",
        f"trainer.ray_address={address}",
        f"trainer.output_dir={tmp_path / 'run'}",
    ]
    cmd = [sys.executable, "-m", "tether.cli", "train", *args]
    env = {k: v for k, v in os.environ.items() if k != FAULT_ENV} | {"OMP_NUM_THREADS": "1"}
    killed = subprocess.run(cmd, env=env | {FAULT_ENV: "kill:4:weights"}, capture_output=True, text=True, timeout=600)
    assert killed.returncode == -9, killed.stderr[-2000:]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "resumed from" in done.stderr and "step_000002" in done.stderr
    _compare(metrics, _metrics(tmp_path / "run"), tol=1e-6)
    assert ray.is_initialized() and ray.cluster_resources().get("CPU") == 4


def test_cli_sigkill_of_a_rank_names_the_checkpoint_and_the_command_then_resumes(
    cluster, tmp_path, sharded_run, monkeypatch, capsys
):
    """Rank 0 SIGKILLed during step 3 (before its update): `tether train` ends with one line naming the dead rank and
    the last complete checkpoint (step 2), then the command that continues, exit status 5 and no traceback; that
    command resumes from step 2 on fresh workers and ends with the uninterrupted run's metrics."""
    import re
    import shlex
    import signal

    from tether.cli import WORKER_FAILED_EXIT, main

    _, metrics, _ = sharded_run
    run = tmp_path / "run"
    args = [*SMALL, "trainer.backend=ray", "trainer.n_workers=2", "trainer.total_steps=4", f"trainer.output_dir={run}"]
    update_actor = Trainer.update_actor

    def kill_rank_0_at_step_3(self, batch):
        if self.step == 3:
            os.kill(ray.get(self.roles.placement.actor_group.workers[0].pid.remote()), signal.SIGKILL)
        return update_actor(self, batch)

    monkeypatch.setattr(Trainer, "update_actor", kill_rank_0_at_step_3)
    assert main(["train", *args]) == WORKER_FAILED_EXIT
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [x for x in err.splitlines() if x.startswith("tether train: ")]
    assert len(lines) == 1 and re.fullmatch(
        r"tether train: actor\+ref worker group: rank 0 died during update_actor \(.+\); the run cannot continue; the "
        r"last complete checkpoint is step 2\. To continue:",
        lines[0],
    ), err[-3000:]
    command = err.split("To continue:\n  ", 1)[1].splitlines()[0]
    assert shlex.split(command) == ["tether", "train", *args]
    assert [r["step"] for r in _metrics(run)] == [0, 1, 2]
    monkeypatch.undo()
    assert main(shlex.split(command)[1:]) == 0
    _compare(metrics, _metrics(run), tol=1e-6)  # steps 3-4 from the step-2 checkpoint, as the uninterrupted run


def test_rollback_restores_sharded_weights_and_keeps_the_lr(sharded_run, tmp_path):
    """The guard's rollback path (CheckpointManager.restore_weights) on the Ray backend: the weights
    and AdamW moments of the step-2 checkpoint come back, the current (lowered) learning rate stays."""
    root, _, _ = sharded_run
    ckpt = root / "a" / "checkpoints" / "step_000002"
    t = Trainer(
        _cfg(
            tmp_path / "b",
            "trainer.backend=ray",
            "trainer.n_workers=2",
            "trainer.total_steps=4",
            f"trainer.resume={ckpt}",
        )
    )
    at_2 = _weights(t.roles.actor.model)
    lr = t.roles.actor.optimizer.param_groups[0]["lr"]
    t.train_step()
    assert _max_diff(at_2, _weights(t.roles.actor.model)) > 1e-4  # it trained
    t.roles.actor.scale_lr(0.5)
    t.ckpt.restore_weights(2)
    assert _max_diff(at_2, _weights(t.roles.actor.model)) == 0.0
    assert t.roles.actor.optimizer.param_groups[0]["lr"] == pytest.approx(lr * 0.5)
    t.roles.close()


def test_sigterm_to_the_whole_process_group_still_checkpoints_and_exits_143(tmp_path):
    """`timeout`, `kill -- -PGID` or a batch scheduler signal every process of the job, the local Ray
    that tether started included. The run still finishes its step, writes that checkpoint and exits
    143 with the command that continues it: tearing the workers down one by one needed Ray's GCS,
    which was shutting down too, and hung until Ray's 60 s reconnect timeout ended the driver with
    exit code 1. When the signal reaches a worker before the step's last call to it, the step is abandoned as by a
    second signal (a race: the checkpoint and exit then name the last complete checkpoint)."""
    import signal
    import subprocess
    import sys
    import time

    run = tmp_path / "run"
    tmp = Path(os.environ.get("TMPDIR", Path(__file__).parents[2] / ".tmp"))
    ray_tmp = tmp if len(str(tmp / "ray")) <= 48 else Path(tempfile.mkdtemp(prefix="tether-ray-", dir="/tmp"))
    env = dict(
        os.environ, RAY_AUTH_MODE="disabled", TMPDIR=str(ray_tmp), PYTHONPATH=str(Path(__file__).parents[2] / "src")
    )
    cmd = [
        sys.executable,
        "-m",
        "tether.cli",
        "train",
        "trainer.backend=ray",
        "trainer.n_workers=2",
        "trainer.threads=1",
        "trainer.total_steps=100000",
        "trainer.save_freq=0",
        "trainer.val_freq=0",
        "trainer.progress=false",
        "trainer.report=false",
        "trainer.loggers=[jsonl]",
        f"trainer.output_dir={run}",
    ]
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 120
        while not ((run / "metrics.jsonl").exists() and len(_metrics(run)) >= 2):
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "no progress"
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGTERM)  # the driver, Ray's GCS and raylet, and the workers alike
        t0 = time.monotonic()
        _, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    done = max(r["step"] for r in _metrics(run))
    assert proc.returncode == 143, err[-3000:]
    if "abandoning it without a new checkpoint" in err:
        # the signal reached the workers (or Ray's raylet) before the step's last call to them: the step is abandoned
        # as by a second signal, and the exit names the last complete checkpoint (none here: trainer.save_freq=0)
        assert (
            "the step in progress failed after it (WorkerDiedError" in err and "no checkpoint was written yet" in err
        ), err[-3000:]
    else:  # the usual case: the step finished before the workers went, and was checkpointed
        assert f"tether train: stopped by SIGTERM after step {done}; checkpoint step {done} written" in err
        assert (run / "checkpoints" / f"step_{done:06d}").is_dir()
    assert time.monotonic() - t0 < 45  # not Ray's 60 s GCS reconnect timeout


def test_a_sharded_checkpoints_failure_is_named_by_each_ranks_own_error():
    """DCP's CheckpointException (a sharded save that failed on some ranks) buries each rank's error
    at the end of a traceback per rank: the message gives those errors (a full disk here)."""
    from torch.distributed.checkpoint.api import CheckpointException

    from tether.distributed.ray_backend import failure_text

    full = OSError(28, "No space left on device")
    e = CheckpointException("save failed", {1: (full, None), 0: (OSError(28, "No space left on device"), None)})
    assert failure_text(e) == (
        "CheckpointException (rank 0: OSError: [Errno 28] No space left on device; rank 1: OSError: [Errno 28] No "
        "space left on device)"
    )
    assert failure_text(RuntimeError("boom")) == "RuntimeError: boom"
