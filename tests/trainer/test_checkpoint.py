"""Checkpoint files: atomic writes, integrity checks, retention, safe loading, and ``tether export``."""

import json
import os
import random
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from tether.checkpoint import (
    FAULT_ENV,
    MANIFEST,
    CheckpointError,
    CheckpointWriteError,
    latest_valid_checkpoint,
    list_checkpoints,
    load_torch,
    prune_checkpoints,
    rng_state,
    save_torch,
    set_rng_state,
    verify_checkpoint,
    write_checkpoint,
)


def _writers(payload: bytes = b"x" * 1000):
    def weights(d):
        (d / "actor").mkdir()
        (d / "actor" / "model.safetensors").write_bytes(payload)

    def optim(d):
        save_torch({"lr": torch.tensor([0.5])}, d / "optim.pt")

    def state(d):
        (d / "trainer_state.json").write_text(json.dumps({"step": 1}))

    return {"weights": weights, "optim": optim, "state": state}


def test_write_then_verify_lists_every_file(tmp_path):
    path = write_checkpoint(tmp_path, 7, _writers())
    assert path == tmp_path / "step_000007"
    manifest = verify_checkpoint(path)
    assert manifest["step"] == 7
    assert sorted(manifest["files"]) == ["actor/model.safetensors", "optim.pt", "trainer_state.json"]
    assert manifest["files"]["actor/model.safetensors"]["bytes"] == 1000
    assert not list(tmp_path.glob(".tmp-*"))


@pytest.mark.parametrize(
    "damage, expected",
    [
        pytest.param(
            lambda p: (p / "optim.pt").write_bytes((p / "optim.pt").read_bytes()[:-7]),
            r"file optim\.pt has \d+ bytes, expected \d+ \(truncated\?\)",
            id="truncated",
        ),
        pytest.param(
            lambda p: (p / "actor" / "model.safetensors").write_bytes(b"y" * 1000),
            r"file actor/model\.safetensors fails its sha256 check",
            id="same-size-flip",
        ),
        pytest.param(
            lambda p: (p / "trainer_state.json").unlink(), r"file trainer_state\.json is missing", id="missing"
        ),
        pytest.param(lambda p: (p / MANIFEST).unlink(), r"step_\d+: incomplete \(no MANIFEST\.json", id="no-manifest"),
        pytest.param(
            lambda p: (p / MANIFEST).write_text('{"files": {'),
            r"file MANIFEST\.json is corrupt",
            id="manifest-not-json",
        ),
        pytest.param(
            lambda p: (p / MANIFEST).write_text('{"files": {"../x": {"bytes": 1, "sha256": "0"}}}'),
            r"outside the checkpoint",
            id="manifest-escape",
        ),
    ],
)
def test_damage_is_detected_and_names_the_file(tmp_path, damage, expected):
    path = write_checkpoint(tmp_path, 3, _writers())
    damage(path)
    with pytest.raises(CheckpointError, match=expected) as err:
        verify_checkpoint(path)
    assert "step_000003" in str(err.value)


def test_latest_valid_falls_back_and_reports(tmp_path, caplog):
    for step in (2, 4, 6):
        write_checkpoint(tmp_path, step, _writers())
    p6 = tmp_path / "step_000006"
    (p6 / "optim.pt").write_bytes(b"")
    errors = []
    assert latest_valid_checkpoint(tmp_path, errors) == tmp_path / "step_000004"
    assert len(errors) == 1 and "step_000006" in errors[0] and "optim.pt" in errors[0]
    assert "optim.pt" in caplog.text
    (tmp_path / "step_000004" / MANIFEST).unlink()
    assert latest_valid_checkpoint(tmp_path) == tmp_path / "step_000002"


def test_an_interrupted_write_leaves_no_checkpoint(tmp_path):
    def boom(d):
        raise OSError("disk full")

    write_checkpoint(tmp_path, 2, _writers())
    with pytest.raises(
        CheckpointWriteError,
        match=r"checkpoint step 4 not written to .*: OSError: disk full; the partial write was removed",
    ):
        write_checkpoint(tmp_path, 4, _writers() | {"state": boom})
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2]
    # removed (a SIGKILL leaves it: the next write or prune clears it)
    assert not (tmp_path / ".tmp-step_000004").exists()
    assert latest_valid_checkpoint(tmp_path) == tmp_path / "step_000002"


@pytest.mark.slow
def test_fault_hook_kills_the_writer_mid_checkpoint(tmp_path):
    """The documented test-only hook: SIGKILL after the named part, before the manifest and rename."""
    code = textwrap.dedent(
        f"""
        import json, pathlib, sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_checkpoint import _writers
        from tether.checkpoint import write_checkpoint
        root = pathlib.Path({str(tmp_path)!r})
        write_checkpoint(root, 1, _writers())
        write_checkpoint(root, 2, _writers())
        print("not reached")
        """
    )
    env = dict(os.environ, **{FAULT_ENV: "kill:2:optim"})
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == -9, proc.stderr
    assert "not reached" not in proc.stdout
    tmp = tmp_path / ".tmp-step_000002"
    assert (tmp / "optim.pt").is_file() and not (tmp / "trainer_state.json").exists() and not (tmp / MANIFEST).exists()
    assert [s for s, _ in list_checkpoints(tmp_path)] == [1]


def test_fault_hook_rejects_a_malformed_spec(tmp_path, monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "kill:two")
    with pytest.raises(ValueError, match=FAULT_ENV):
        write_checkpoint(tmp_path, 2, _writers())
    monkeypatch.setenv(FAULT_ENV, "kill:3:weights")  # another step: no effect
    assert verify_checkpoint(write_checkpoint(tmp_path, 2, _writers()))["step"] == 2


def test_prune_keeps_last_and_protected(tmp_path):
    for step in range(1, 7):
        write_checkpoint(tmp_path, step, _writers())
    (tmp_path / ".tmp-step_000007").mkdir()
    prune_checkpoints(tmp_path, keep_last=2, protect={2})
    assert [s for s, _ in list_checkpoints(tmp_path)] == [6, 5, 2]
    assert not (tmp_path / ".tmp-step_000007").exists()


def test_rng_state_round_trips_through_json():
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    state = json.loads(json.dumps(rng_state()))
    expected = (random.random(), np.random.rand(3).tolist(), torch.rand(3).tolist())
    random.seed(9)
    np.random.seed(9)
    torch.manual_seed(9)
    set_rng_state(state)
    assert (random.random(), np.random.rand(3).tolist(), torch.rand(3).tolist()) == expected


class _Payload:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_load_torch_never_unpickles_arbitrary_objects(tmp_path):
    torch.save({"x": _Payload()}, tmp_path / "evil.pt")
    with pytest.raises(Exception, match="(?i)weights_only|unsupported|global"):
        load_torch(tmp_path / "evil.pt")
    save_torch({"a": torch.arange(3), "b": [1, 2.5, "s"]}, tmp_path / "ok.pt")
    assert torch.equal(load_torch(tmp_path / "ok.pt")["a"], torch.arange(3))


# ---------------------------------------------------------------------------------- with a trainer

TINY = [
    "trainer.progress=false",
    "trainer.threads=1",
    "trainer.report=false",
    "trainer.loggers=[jsonl]",
    "trainer.val_freq=0",
    "trainer.save_freq=2",
    "data.batch_size=4",
    "data.embedded_train_size=8",
    "rollout.n=4",
    "algo.mini_batch_size=8",
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 2-step run of the tiny model; its trainer and run directory."""
    from tether.config import load_config
    from tether.trainer import Trainer

    out = tmp_path_factory.mktemp("ckpt") / "run"
    cfg = load_config(None, [*TINY, f"trainer.output_dir={out}", "trainer.total_steps=2"])
    t = Trainer(cfg)
    t.fit()
    return t, out


@pytest.mark.slow
def test_checkpoint_files_are_safetensors_json_and_tensor_only_torch(trained):
    _, out = trained
    ckpt = out / "checkpoints" / "step_000002"
    names = sorted(verify_checkpoint(ckpt)["files"])
    assert "actor/model.safetensors" in names and "actor/config.json" in names and "actor/tokenizer.json" in names
    assert {"optim.pt", "rng.json", "trainer_state.json"} <= set(names)
    assert not [n for n in names if n.endswith((".bin", ".pkl", ".pickle"))]
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["step"] == 2 and state["data"] == {"epoch": 1, "index": 0, "n": 8}
    optim = load_torch(ckpt / "optim.pt")  # weights_only=True
    # 2 steps x 2 mini-batches
    assert set(optim) == {"actor", "actor_sched"} and optim["actor_sched"]["last_epoch"] == 4


@pytest.mark.slow
def test_export_loads_with_identical_logits(trained, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tether.export import export_checkpoint

    t, out = trained
    dst = export_checkpoint(out / "checkpoints" / "step_000002", tmp_path / "hf")
    assert (dst / "model.safetensors").is_file() and (dst / "config.json").is_file()
    model = AutoModelForCausalLM.from_pretrained(dst).eval()
    tok = AutoTokenizer.from_pretrained(dst)
    ids = torch.tensor([t.train_set.ids[0] + t.train_set.ids[1][:3]])
    actor = t.roles.actor.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, actor(ids).logits, rtol=0, atol=0)
    text = t.train_set.texts[0]
    assert tok(text)["input_ids"] == t.tok(text)["input_ids"] == t.train_set.ids[0]
    with pytest.raises(CheckpointError, match="not an empty directory"):
        export_checkpoint(out / "checkpoints" / "step_000002", tmp_path / "hf")
    assert (dst / "model.safetensors").is_file()  # never deleted


@pytest.mark.slow
def test_export_cli_names_the_corrupt_file(trained, tmp_path, capsys):
    import shutil

    from tether.cli import main

    _, out = trained
    bad = tmp_path / "step_000002"
    shutil.copytree(out / "checkpoints" / "step_000002", bad)
    f = bad / "actor" / "model.safetensors"
    f.write_bytes(f.read_bytes()[:100])
    assert main(["export", str(bad), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert "actor/model.safetensors" in err and "truncated" in err
    assert not (tmp_path / "hf").exists()


@pytest.mark.slow
def test_retention_keeps_last_plus_best_and_labels_only_validated_steps(tmp_path, monkeypatch):
    import tether.trainer.trainer as trainer_module  # the loop calls validate through its module
    from tether.config import load_config
    from tether.trainer import Trainer

    scores = iter([0.5, 0.9, 0.88, 0.87])  # steps 0, 2, 4, 5: validation every 2 steps and at the end
    monkeypatch.setattr(trainer_module, "validate", lambda *a, **k: {"val/score_mean": next(scores)})
    run = tmp_path / "run"
    overrides = [
        "trainer.total_steps=5",
        "trainer.save_freq=1",
        "trainer.val_freq=2",
        "trainer.keep_last=1",
        "guard.rollback_drop=0.05",
    ]
    t = Trainer(load_config(None, [*TINY, f"trainer.output_dir={run}", *overrides]))
    kept = []
    save = t.ckpt.save

    def spy(*a, **kw):
        path = save(*a, **kw)
        kept.append(sorted(p.name for p in (run / "checkpoints").iterdir()))
        return path

    t.ckpt.save = spy
    t.fit()
    assert kept == [
        ["step_000001"],
        ["step_000002"],
        ["step_000002", "step_000003"],  # 3 was not validated: no score, so 2 stays best and stable
        ["step_000002", "step_000004"],  # 0.88: stable (within 5% of 0.9), not best
        ["step_000002", "step_000005"],
    ]
    states = {
        s: json.loads((run / "checkpoints" / f"step_00000{s}" / "trainer_state.json").read_text()) for s in (2, 5)
    }
    assert states[2]["val_score"] == 0.9 and states[2]["best"] == {"step": 2, "score": 0.9}
    assert states[5]["val_score"] == 0.87 and states[5]["best"] == {"step": 2, "score": 0.9}
    assert states[5]["guard"]["stable_step"] == 5 and states[5]["guard"]["stable_score"] == 0.87


def test_verify_only_a_prefix_ignores_damage_elsewhere(tmp_path):
    path = write_checkpoint(tmp_path, 3, _writers())
    (path / "optim.pt").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="file optim.pt has 7 bytes"):
        verify_checkpoint(path)
    assert verify_checkpoint(path, only="actor/")["step"] == 3
    assert latest_valid_checkpoint(tmp_path) is None and latest_valid_checkpoint(tmp_path, only="actor/") == path
    (path / "actor" / "model.safetensors").write_bytes(b"y" * 1000)
    with pytest.raises(CheckpointError, match="actor/model.safetensors fails its sha256 check"):
        verify_checkpoint(path, only="actor/")
    with pytest.raises(CheckpointError, match="lists no critic/ files"):
        verify_checkpoint(path, only="critic/")


def test_export_says_what_a_path_is_when_it_is_not_a_checkpoint(tmp_path):
    from tether.export import resolve_checkpoint

    with pytest.raises(CheckpointError, match=r"does not exist \(expected a checkpoint"):
        resolve_checkpoint(tmp_path / "nope")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="is a Hugging Face model directory .* there is nothing to export"):
        resolve_checkpoint(model)
    (model / "adapter_config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="is a peft adapter directory, not a tether checkpoint"):
        resolve_checkpoint(model)
    with pytest.raises(
        CheckpointError, match=r"is not a tether checkpoint \(no actor/ or MANIFEST.json\) nor a run directory"
    ):
        resolve_checkpoint(tmp_path)
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    with pytest.raises(
        CheckpointError, match="run directory .* holds no checkpoint with complete actor weights: it has none yet"
    ):
        resolve_checkpoint(run)
    write_checkpoint(run / "checkpoints", 2, _writers())
    newest = write_checkpoint(run / "checkpoints", 4, _writers())
    (newest / "optim.pt").write_bytes(b"garbage")  # export needs only actor/: step 4 is still the one
    assert resolve_checkpoint(run) == newest
    (newest / "actor" / "model.safetensors").write_bytes(b"y" * 1000)
    assert resolve_checkpoint(run) == run / "checkpoints" / "step_000002"


@pytest.mark.slow
def test_export_a_run_directory_and_a_checkpoint_with_a_damaged_optimizer(trained, tmp_path, capsys, caplog):
    import shutil

    from tether.cli import main

    _, out = trained
    run = tmp_path / "run"
    shutil.copytree(out, run)
    latest = latest_valid_checkpoint(run / "checkpoints")
    assert main(["export", str(run), str(tmp_path / "from_run")]) == 0
    assert (tmp_path / "from_run" / "model.safetensors").read_bytes() == (
        latest / "actor" / "model.safetensors"
    ).read_bytes()
    (latest / "optim.pt").write_bytes(b"not an optimizer")
    assert main(["export", str(latest), str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "model.safetensors").read_bytes() == (latest / "actor" / "model.safetensors").read_bytes()
    assert "file optim.pt has 16 bytes" in caplog.text and "the actor's files verify" in caplog.text
    assert main(["export", str(run / "config.yaml"), str(tmp_path / "x")]) == 2
    assert "is not a tether checkpoint" in capsys.readouterr().err


def test_prune_does_not_count_a_corrupt_checkpoint_and_sets_it_aside(tmp_path, caplog):
    # the trial's case: step 20 corrupt (sha256), keep_last=1: step 15 must stay, step 20 be moved aside, not deleted
    for step in (10, 15, 20):
        write_checkpoint(tmp_path, step, _writers())
    (tmp_path / "step_000020" / "actor" / "model.safetensors").write_bytes(b"y" * 1000)
    (tmp_path / "step_000025").mkdir()  # incomplete: no manifest
    with caplog.at_level("WARNING", logger="tether"):
        moved = prune_checkpoints(tmp_path, keep_last=1, protect=set())
    assert [s for s, _ in list_checkpoints(tmp_path)] == [15]
    assert sorted(p.name for p in moved) == ["corrupt-step_000020", "corrupt-step_000025"]
    assert (tmp_path / "corrupt-step_000020" / "actor" / "model.safetensors").read_bytes() == b"y" * 1000
    assert "step_000020: file actor/model.safetensors fails its sha256 check" in caplog.text
    assert latest_valid_checkpoint(tmp_path) == tmp_path / "step_000015"
    write_checkpoint(tmp_path, 20, _writers())
    (tmp_path / "step_000020" / "optim.pt").write_bytes(b"z")
    assert [p.name for p in prune_checkpoints(tmp_path, keep_last=1, protect=set())] == ["corrupt-step_000020-1"]


def test_prune_cache_hashes_a_checkpoint_once_and_sees_a_rewrite(tmp_path, monkeypatch):
    import tether.checkpoint as ck

    verified: dict = {}
    for step in (1, 2):
        write_checkpoint(tmp_path, step, _writers(), verified)
    calls = []
    real = ck.verify_checkpoint
    monkeypatch.setattr(ck, "verify_checkpoint", lambda p, **kw: calls.append(p.name) or real(p, **kw))
    assert prune_checkpoints(tmp_path, keep_last=2, protect=set(), verified=verified) == []
    assert calls == []  # both entered by write_checkpoint: not hashed again
    p = tmp_path / "step_000002" / "optim.pt"
    p.write_bytes(b"q" * p.stat().st_size)  # same size, new mtime
    os.utime(p, ns=(p.stat().st_atime_ns, p.stat().st_mtime_ns + 10**9))
    assert [m.name for m in prune_checkpoints(tmp_path, keep_last=2, protect=set(), verified=verified)] == [
        "corrupt-step_000002"
    ]
    assert calls == ["step_000002"]
