"""The architecture of docs/architecture.md, checked: the layers (import-linter), one role interface that the local
roles and the Ray stand-ins both satisfy, trainer.backend read only by the factory, the placement and the config, and
engine names known only to the engines and their registry."""

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

#: the only modules that may read trainer.backend: the role factory, the placement, the config's own validation (with
#: the engine registry's cross-checks, moved out of it), and the memory planner (its note that --devices N plans for
#: the Ray backend)
BACKEND_READERS = {"workers/build.py", "placement.py", "config.py", "engines.py", "plan.py"}


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


def _engine_name_uses(tree: ast.AST, names: set[str]) -> list[int]:
    """Lines that compare a value with an engine's name (``x == "vllm"``, ``x in ("hf", "auto")``), key or
    index something by one (``{"vllm": ...}``, ``x["hf"]``, ``getattr(cfg.rollout, "vllm")``), or read an engine's
    settings section by attribute (``cfg.rollout.vllm``)."""

    def named(node) -> bool:
        if isinstance(node, ast.Constant):
            return node.value in names
        return isinstance(node, (ast.Tuple, ast.List, ast.Set)) and any(named(e) for e in node.elts)

    lines = []
    for n in ast.walk(tree):
        if (
            (isinstance(n, ast.Compare) and any(named(x) for x in [n.left, *n.comparators]))
            or (isinstance(n, ast.Dict) and any(k is not None and named(k) for k in n.keys))
            or (isinstance(n, ast.Subscript) and named(n.slice))
            or (
                isinstance(n, ast.Call)
                and getattr(n.func, "id", None) in ("getattr", "hasattr")
                and any(named(a) for a in n.args)
            )
            or (
                isinstance(n, ast.Attribute)
                and n.attr in names
                and isinstance(n.value, ast.Attribute)
                and n.value.attr == "rollout"
            )
            or (isinstance(n, ast.match_case) and named(getattr(n.pattern, "value", None)))
        ):
            lines.append(n.lineno)
    return sorted(set(lines))


def test_engine_names_are_known_only_to_the_engines_and_their_registry():
    """Outside tether/rollout/ (the engines and the registry's builders) and tether/engines.py (the registry) no code
    compares, keys or indexes by an engine's name or reads its settings section: an engine is one module and one
    entry, and whatever depends on which engine runs asks the entry or the engine (its capabilities)."""
    from tether.engines import ENGINES

    names = set(ENGINES)
    assert _engine_name_uses(ast.parse('if cfg.rollout.engine == "vllm": pass'), names) == [1]  # the check sees one
    assert _engine_name_uses(ast.parse("x = cfg.rollout.vllm.replicas"), names) == [1]
    assert _engine_name_uses(ast.parse('e = {"hf": 1}\nf = getattr(r, "vllm")'), names) == [1, 2]
    found = {}
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel.startswith("rollout/") or rel == "engines.py":
            continue
        if lines := _engine_name_uses(ast.parse(path.read_text()), names):
            found[rel] = lines
    assert not found, found


def test_every_engine_satisfies_the_generation_protocol_and_its_entry_resolves():
    """Each registered engine's module provides the registry's hooks, and its engine class the protocol; the engines
    tether ships are importable without their optional dependency (vLLM's module imports vllm only when it builds)."""
    import inspect

    from tether.engines import ENGINES, auto_order, fallback
    from tether.rollout import registry
    from tether.rollout.engine import EngineCapabilities, GenerationEngine
    from tether.rollout.hf import HFRolloutEngine
    from tether.rollout.vllm import VLLMRolloutEngine

    for name, e in ENGINES.items():
        module = registry.engine_module(name)
        assert callable(module.build) and callable(module.check_usable), name
        assert list(inspect.signature(module.build).parameters) == [
            "cfg",
            "model",
            "tokenizer",
            "model_path",
            "eos_token_ids",
        ], name
        if e.on_ray == "replicas":
            assert callable(module.build_replica) and e.section is not None, name
            assert {"replicas", "tensor_parallel_size", "sync_bucket_mib"} <= set(e.section.model_fields), name
        assert e.plan is not None, name  # tether plan counts every engine's memory
    assert fallback() is auto_order()[-1] and fallback().name == "hf"
    for cls in (HFRolloutEngine, VLLMRolloutEngine):
        for member in ("generate", "sync_weights", "sleep", "wake", "close"):
            assert callable(getattr(cls, member)), (cls, member)
    hf = HFRolloutEngine(torch.nn.Linear(2, 2), type("T", (), {"eos_token_id": 0, "pad_token_id": 0})())
    assert isinstance(hf, GenerationEngine) and isinstance(hf.capabilities, EngineCapabilities)
