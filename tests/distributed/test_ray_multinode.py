"""trainer.nnodes=2 on a real two-node Ray cluster on one machine (ray.cluster_utils.Cluster, both nodes on
127.0.0.1)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from test_ray import SMALL, _compare, _metrics  # noqa: E402 - tests/distributed is on sys.path (rootdir-less prepend import)

from tether.config import load_config  # noqa: E402
from tether.trainer.trainer import Trainer  # noqa: E402


class Crash(Exception):
    pass


@pytest.fixture
def two_nodes(monkeypatch):
    """A head and a worker node of 2 CPUs each, both bound to 127.0.0.1; the driver attaches by address.

    Each node could hold both ranks of a world-size-2 group, so one rank per node is tether's doing
    (trainer.nnodes), not the cluster's shape. Ray replaces a loopback host in ``ray.init(address=...)``
    by this machine's address, where nothing of this cluster listens; ``ENABLE_RAY_CLUSTER`` off (what
    ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` sets at import) keeps 127.0.0.1. The cluster records its
    address (``ray_current_cluster``, which a plain ``ray.init()`` would join) under a Ray temp directory
    of its own, so that no other Ray started meanwhile on this machine attaches to it."""
    from ray._private import ray_constants
    from ray.cluster_utils import Cluster

    assert not ray.is_initialized()  # tether must attach itself, not find a Ray this process joined
    # Ray's unix sockets live at <temp_dir>/session_<date>_<pid>/sockets/plasma_store, ~80 characters under temp_dir,
    # and
    # AF_UNIX paths stop at 107 bytes: the project's .tmp is short enough only in a shallow checkout (CI's clone was
    # not)
    tmp = Path(os.environ.get("TMPDIR", Path(__file__).parents[2] / ".tmp"))
    tmp.mkdir(parents=True, exist_ok=True)
    own = Path(tempfile.mkdtemp(prefix="t2n-", dir=tmp if len(str(tmp)) <= 12 else "/tmp"))  # removed at the end
    monkeypatch.setenv("RAY_TMPDIR", str(own))
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", False)
    node = dict(num_cpus=2, node_ip_address="127.0.0.1", object_store_memory=100 * 2**20, temp_dir=str(own / "ray"))
    cluster = Cluster(initialize_head=True, head_node_args=dict(node, include_dashboard=False))
    try:
        cluster.add_node(**node)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(own, ignore_errors=True)


def _node_ids(trainer: Trainer) -> list[str]:
    """The Ray node id each rank of the actor group runs on, asked of the rank itself."""
    workers = trainer.roles.placement.actor_group.workers
    return ray.get([w.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()) for w in workers])


@pytest.mark.slow
def test_two_nodes_one_rank_each_sharded_checkpoint_and_resume_equal_the_local_run(two_nodes, tmp_path):
    """trainer.nnodes=2 trainer.n_workers=2 attached to a two-node cluster: rank 0 and rank 1 run on
    the two different nodes (each node has room for both: without trainer.nnodes spreading them, PACK
    put both on one); 3 steps (validation at steps 0, 2, 3), interrupted after step 2 with its sharded
    checkpoint (one DCP shard per rank, each written by its own node), resumed from it on fresh
    workers: every non-timing metric of steps 0-3 within 1e-5 of the local backend's uninterrupted run,
    and the driver's final weights within 1e-5. Then trainer.nnodes=3 on these two nodes fails naming
    the key, and leaves no placement group behind."""
    local = Trainer(load_config(None, [*SMALL, f"trainer.output_dir={tmp_path / 'local'}"]))
    local.fit()

    run = tmp_path / "ray"
    cfg = load_config(
        None,
        [
            *SMALL,
            f"trainer.output_dir={run}",
            "trainer.backend=ray",
            "trainer.n_workers=2",
            "trainer.nnodes=2",
            f"trainer.ray_address={two_nodes.address}",
        ],
    )
    first = Trainer(cfg)
    assert not first.roles.placement.cluster.started  # attached, not a local Ray
    alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert len(alive) == 2
    placed = _node_ids(first)
    assert len(set(placed)) == 2 and set(placed) == alive  # one rank on each node
    step = first.train_step

    def crash_after_2():
        if first.step >= 2:
            raise Crash
        return step()

    first.train_step = crash_after_2
    with pytest.raises(Crash):
        first.fit()
    ckpt = run / "checkpoints" / "step_000002"
    assert {p.name for p in (ckpt / "dcp").iterdir()} >= {".metadata", "__0_0.distcp", "__1_0.distcp"}
    assert ray.is_initialized() and first.roles.placement.groups == []  # the crash closed its groups, the cluster stays

    resumed = Trainer(cfg)  # trainer.resume=auto: the step-2 checkpoint
    assert resumed.step == 2
    assert sorted(_node_ids(resumed)) == sorted(placed)  # spread over both nodes again
    resumed.fit()
    got = _metrics(run)
    assert [r["step"] for r in got] == [0, 1, 2, 3]
    _compare(_metrics(tmp_path / "local"), got)
    wl, wr = dict(local.roles.actor.model.named_parameters()), dict(resumed.roles.actor.model.named_parameters())
    assert max(float((wl[k] - wr[k]).detach().abs().max()) for k in wl) < 1e-5

    from tether.distributed.ray_backend import WorkerDiedError, spread_over_nodes

    with pytest.raises(
        WorkerDiedError,
        match=r"^actor\+ref worker group: trainer.nnodes=3, but Ray found no 3 distinct nodes with room for 1 bundles "
        r"of \{'CPU': 1\} each within 2 s \(2 alive node\(s\), available: ",
    ):
        spread_over_nodes("actor+ref", 3, 3, {"CPU": 1}, 2.0)
    assert ray.util.placement_group_table() and all(
        pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values()
    )


def test_nnodes_must_divide_the_ranks(tmp_path):
    """Ranks are spread evenly (n_workers / nnodes per node): a remainder is refused when the config loads."""
    from tether.config import ConfigError

    with pytest.raises(
        ConfigError,
        match=r"trainer.n_workers=3 must be a multiple of trainer.nnodes=2 \(the same number of ranks on every node\)",
    ):
        load_config(
            None,
            [
                *SMALL,
                f"trainer.output_dir={tmp_path}",
                "trainer.backend=ray",
                "trainer.n_workers=3",
                "trainer.nnodes=2",
            ],
        )
    assert not ray.is_initialized()


def test_nnodes_on_the_local_ray_tether_starts_is_refused_at_once(monkeypatch):
    """The local Ray tether starts is one node: its placement groups would wait 120 s for a second one."""
    from tether.config import ConfigError
    from tether.distributed.ray_backend import RayCluster

    local = RayCluster.__new__(RayCluster)  # as if it had started a local Ray
    local.started = True
    closed = []
    monkeypatch.setattr(local, "close", lambda: closed.append(True))
    local.check_nodes(1)
    with pytest.raises(
        ConfigError,
        match=r"^trainer.nnodes=2, but without trainer.ray_address tether starts a one-node local Ray; attach",
    ):
        local.check_nodes(2)
    assert closed == [True]  # shut down before the error
    local.started = False
    local.check_nodes(2)  # attached: left to the placement groups
