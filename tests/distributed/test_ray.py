"""trainer.backend=ray against a real local Ray cluster (one per module: ray.init takes ~10 s)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from tether.config import ConfigError, load_config  # noqa: E402
from tether.trainer.trainer import Trainer  # noqa: E402

pytestmark = pytest.mark.slow

SMALL = ["trainer.total_steps=3", "trainer.progress=false", "trainer.val_freq=2", "trainer.save_freq=2", "trainer.threads=1",
         "data.batch_size=4", "data.embedded_train_size=8", "data.embedded_val_size=4", "rollout.n=4", "trainer.val_n=2",
         "algo.mini_batch_size=8", "actor.micro_batch_size=3", "trainer.report=false", "trainer.loggers=[jsonl]"]  # fmt: skip
NOT_COMPARED = ("timing/", "perf/")


@pytest.fixture(scope="module")
def cluster():
    """One local Ray for the module, with auth off and its files under the project's TMPDIR."""
    tmp = Path(os.environ.get("TMPDIR", Path(__file__).parents[2] / ".tmp"))
    tmp.mkdir(parents=True, exist_ok=True)
    os.environ["RAY_AUTH_MODE"] = "disabled"
    os.environ["TMPDIR"] = str(tmp)
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, _temp_dir=str(tmp / "ray"))
    yield
    ray.shutdown()


def _cfg(out, *extra):
    return load_config(None, [*SMALL, f"trainer.output_dir={out}", *extra])


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _compare(a: list[dict], b: list[dict], tol: float = 1e-5) -> None:
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b, strict=True):
        keys = {k for k in ra if not k.startswith(NOT_COMPARED)}
        assert keys == {k for k in rb if not k.startswith(NOT_COMPARED)}, ra["step"]
        for k in keys:
            va, vb = ra[k], rb[k]
            if isinstance(va, float) and math.isnan(va):
                assert math.isnan(vb), (ra["step"], k)
            else:
                assert vb == pytest.approx(va, abs=tol, rel=tol), (ra["step"], k, va, vb)


@pytest.mark.parametrize("extra", [[], ["algo.adv_estimator=gae", "trainer.placement=split"]], ids=["grpo", "gae-split"])
def test_ray_world_size_2_equals_local(cluster, tmp_path, extra):
    """Three steps of the embedded task: every non-timing metric (validation and exact/* included)
    of trainer.backend=ray with 2 FSDP2 workers within 1e-5 of the local backend's, and the driver's
    copy of the final weights within 1e-5."""
    local = Trainer(_cfg(tmp_path / "local", *extra))
    local.fit()
    remote = Trainer(_cfg(tmp_path / "ray", "trainer.backend=ray", "trainer.n_workers=2", *extra))
    remote.fit()
    _compare(_metrics(tmp_path / "local"), _metrics(tmp_path / "ray"))
    wl, wr = dict(local.roles.actor.model.named_parameters()), dict(remote.roles.actor.model.named_parameters())
    assert max(float((wl[k] - wr[k]).abs().max()) for k in wl) < 1e-5
    assert remote.roles.backend is None and ray.is_initialized()  # its groups are gone; the module's Ray is not


def test_killed_worker_names_the_role(cluster, tmp_path):
    from tether.distributed.ray_backend import WorkerDiedError

    trainer = Trainer(_cfg(tmp_path / "run", "trainer.backend=ray", "trainer.n_workers=2"))
    trainer.train_step()
    ray.kill(trainer.roles.backend.actor_group.workers[1])
    with pytest.raises(WorkerDiedError, match=r"actor\+ref worker group: rank 1 died"):
        trainer.train_step()
    trainer.roles.close()


def test_bad_degrees_fail_before_start(tmp_path):
    with pytest.raises(ConfigError, match="n_workers=3 must equal"):
        _cfg(tmp_path / "x", "trainer.backend=ray", "trainer.n_workers=3", "trainer.n_gpus_per_node=2")
