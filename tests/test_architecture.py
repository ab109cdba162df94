"""The architecture of docs/architecture.md, checked: the layers (import-linter), one role interface that the local
roles and the Ray stand-ins both satisfy, and trainer.backend read only by the factory, the placement and the config."""

from __future__ import annotations

import ast
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from tether.distributed.ray_backend import RayBackend, RemoteActor, RemoteCritic, RemoteReference
from tether.workers import ActorWorker, CriticWorker, ReferenceWorker
from tether.workers.roles import Critic, LocalPlacement, Placement, Policy, Reference

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "tether"

#: the only modules that may read trainer.backend: the role factory, the placement, the config's own validation, and the
#: memory planner (its note that --devices N plans for the Ray backend)
BACKEND_READERS = {"workers/build.py", "placement.py", "config.py", "plan.py"}


def test_import_layers_and_no_circles():
    """pyproject.toml's import-linter contracts: every import points down the layers, no circle among siblings."""
    exe = shutil.which("lint-imports", path=str(Path(__import__("sys").executable).parent))
    if exe is None:
        pytest.skip("import-linter is not installed (pip install -e '.[test]')")
    out = subprocess.run([exe], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-3000:]
    assert "2 kept, 0 broken" in out.stdout


def _reads_backend(tree: ast.AST) -> list[int]:
    """Lines that read ``<x>.trainer.backend`` (or ``getattr(<x>.trainer, "backend", ...)``)."""

    def trainer(node):
        return isinstance(node, ast.Attribute) and node.attr == "trainer"

    return [
        n.lineno
        for n in ast.walk(tree)
        if (isinstance(n, ast.Attribute) and n.attr == "backend" and trainer(n.value))
        or (
            isinstance(n, ast.Call)
            and getattr(n.func, "id", None) == "getattr"
            and len(n.args) >= 2
            and trainer(n.args[0])
            and isinstance(n.args[1], ast.Constant)
            and n.args[1].value == "backend"
        )
    ]


def test_only_the_factory_the_placement_and_the_config_read_trainer_backend():
    readers = {}
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if lines := _reads_backend(ast.parse(path.read_text())):
            readers[rel] = lines
    assert set(readers) <= BACKEND_READERS, {k: v for k, v in readers.items() if k not in BACKEND_READERS}
    assert {"workers/build.py", "placement.py"} <= set(readers)  # the check can see a read


class _Group:
    """A worker group that answers the one call reading an attribute makes: the learning rate
    (``RemoteActor.optimizer``)."""

    workers = ["rank0"]

    def call(self, method, *args, **kwargs):
        assert method == "lr", method
        return 1e-3


def test_local_roles_and_ray_stand_ins_satisfy_one_interface():
    model = torch.nn.Linear(2, 2)
    actor = ActorWorker(
        model,
        lr=1e-3,
        weight_decay=0.0,
        betas=(0.9, 0.999),
        warmup_steps=0,
        grad_clip=1.0,
        micro_batch_size=2,
        temperature=1.0,
    )
    ref = ReferenceWorker(torch.nn.Linear(2, 2))
    group = _Group()
    remote_actor = RemoteActor(group, model)
    for role in (actor, remote_actor):
        assert isinstance(role, Policy), type(role)
    for role in (ref, RemoteReference(group, ref, remote_actor), RemoteReference(group, None)):
        assert isinstance(role, Reference), type(role)
    critic = CriticWorker(
        torch.nn.Linear(2, 1), lr=1e-3, grad_clip=1.0, micro_batch_size=2, value_clip=0.2, norm_constant=4.0
    )
    for role in (critic, RemoteCritic(group)):
        assert isinstance(role, Critic), type(role)
    assert isinstance(LocalPlacement(), Placement)
    for name in ("save_weights", "save_optimizer", "load", "close"):  # RayBackend needs a cluster to build: its methods
        assert callable(getattr(RayBackend, name)), name
    assert RayBackend.trains_in_process is False and LocalPlacement.trains_in_process is True
    assert remote_actor.model_as_is is model and actor.model_as_is is model
