"""What a local role writes into a checkpoint and reads back, and the one-line errors when the files do not fit."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tether.checkpoint import CheckpointError, verify_checkpoint
from tether.models import apply_lora, load_causal_lm, load_tokenizer, resolve_model_path
from tether.workers.persist import load_policy, save_policy

LORA = SimpleNamespace(rank=4, alpha=8, dropout=0.0, target_modules="all-linear")


@pytest.fixture(scope="module")
def ref():
    path = resolve_model_path("embedded")
    return path, load_tokenizer(path)


def test_a_policy_round_trips_full_and_lora(ref, tmp_path):
    path, tok = ref
    for name, make in {
        "full": lambda: load_causal_lm(path),
        "lora": lambda: apply_lora(load_causal_lm(path), LORA),
    }.items():
        a, b = make(), make()
        with torch.no_grad():
            for p in a.parameters():
                if p.requires_grad:
                    p.add_(0.01)
        save_policy(a, tok, tmp_path / name)
        load_policy(b, tmp_path / name, tmp_path)
        for (k, pa), pb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
            torch.testing.assert_close(pb, pa, rtol=0, atol=0, msg=k)


def test_lora_and_full_checkpoints_say_which_they_are(ref, tmp_path):
    path, tok = ref
    save_policy(load_causal_lm(path), tok, tmp_path / "full")
    save_policy(apply_lora(load_causal_lm(path), LORA), tok, tmp_path / "lora")
    with pytest.raises(
        CheckpointError,
        match=r"actor/adapter_model.safetensors is missing \(it holds a full model: it was saved without actor.lora; "
        r"resume it with actor.lora.rank=0\)$",
    ):
        load_policy(apply_lora(load_causal_lm(path), LORA), tmp_path / "full", tmp_path)
    with pytest.raises(
        CheckpointError,
        match=r"actor/ holds LoRA adapters \(saved with actor.lora.rank > 0\), not a full model: resume it with its "
        r"actor.lora settings$",
    ):
        load_policy(load_causal_lm(path), tmp_path / "lora", tmp_path)


def test_a_file_or_a_run_directory_is_not_a_checkpoint(tmp_path):
    (tmp_path / "run" / "checkpoints" / "step_000002").mkdir(parents=True)
    (tmp_path / "optim.pt").write_bytes(b"x")
    with pytest.raises(CheckpointError, match=r"optim.pt is a file, not a checkpoint directory"):
        verify_checkpoint(tmp_path / "optim.pt")
    with pytest.raises(
        CheckpointError,
        match=r"run is a run directory, not one of its checkpoints: give .*checkpoints/<step> \(step_000002\), or set "
        r"trainer.output_dir='.*run' with trainer.resume=auto to continue the run$",
    ):
        verify_checkpoint(tmp_path / "run")


def test_eval_reads_a_checkpoint_whose_actor_verifies_as_export_does(ref, tmp_path, caplog):
    """tether eval needs only the actor's files: an optim.pt that fails its checksum is a warning (as for tether
    export), a
    damaged actor file is the error."""
    from tether.checkpoint import write_checkpoint
    from tether.config import ConfigError
    from tether.evaluation.evaluate import resolve_policy
    from tether.export import resolve_checkpoint

    path, tok = ref
    ckpt = write_checkpoint(
        tmp_path / "run" / "checkpoints",
        2,
        {
            "weights": lambda d: save_policy(load_causal_lm(path), tok, d / "actor"),
            "optim": lambda d: (d / "optim.pt").write_bytes(b"0" * 8),
        },
    )
    (ckpt / "optim.pt").write_bytes(b"1" * 8)  # same size, another checksum
    assert resolve_policy(ckpt)[:2] == (ckpt / "actor", "model") and resolve_checkpoint(ckpt) == ckpt
    assert resolve_policy(tmp_path / "run")[:2] == (ckpt / "actor", "model")
    assert "optim.pt fails its sha256 check" in caplog.text and "all an evaluation reads" in caplog.text
    (ckpt / "actor" / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"actor/config.json"):
        resolve_policy(ckpt)


def test_a_critic_the_run_does_not_use_is_left_out_when_a_checkpoint_loads(tmp_path):
    """A GAE checkpoint resumed by a run without a critic: its critic is left out (the warning, from the configs'
    algo.adv_estimator whatever the placement, is tests/trainer/test_resume.py's)."""
    from tether.workers.roles import LocalPlacement, Roles

    loaded = []
    actor = SimpleNamespace(
        load=lambda d, c: loaded.append("actor"),
        load_optimizer_state=lambda s, schedule: loaded.append("optim"),
        model="m",
    )
    engine = SimpleNamespace(sync_weights=lambda m: loaded.append(("sync", m)))
    roles = Roles(None, actor, None, None, engine, None, torch.device("cpu"), None)
    (tmp_path / "critic.safetensors").write_bytes(b"x")
    torch.save({"actor": {}, "actor_sched": {}, "critic": {}}, tmp_path / "optim.pt")
    LocalPlacement().load(roles, tmp_path, with_ref=False, schedule=True)
    assert loaded == ["actor", "optim", ("sync", "m")]
