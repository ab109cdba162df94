"""Bad input: a clear error naming the item before training, or a dropped-and-counted sample mid-run."""

import json
import logging
import math
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tether.config import ConfigError
from tether.data import DataError
from tether.tasks.sft import default_reference_path
from tether.trainer import Trainer


def test_model_dir_without_tokenizer(small_cfg, tmp_path):
    model_dir = tmp_path / "no_tok"
    model_dir.mkdir()
    for f in ("config.json", "model.safetensors", "generation_config.json"):
        shutil.copy(default_reference_path() / f, model_dir / f)
    with pytest.raises(ConfigError, match=r"actor.model: .*no_tok holds no tokenizer files"):
        Trainer(small_cfg(f"actor.model={model_dir}"))


def test_model_dir_that_does_not_exist(small_cfg, tmp_path):
    with pytest.raises(ConfigError, match=r"actor.model='.*missing'.*no such local model directory"):
        Trainer(small_cfg(f"actor.model={tmp_path / 'missing'}"))


def test_tokenizer_without_pad_token_falls_back_to_eos_with_a_warning(small_cfg, tmp_path, caplog):
    model_dir = tmp_path / "no_pad"
    shutil.copytree(default_reference_path(), model_dir)
    cfg_path = model_dir / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text())
    tok_cfg.pop("pad_token", None)
    cfg_path.write_text(json.dumps(tok_cfg))
    st = model_dir / "special_tokens_map.json"
    if st.exists():
        m = json.loads(st.read_text())
        m.pop("pad_token", None)
        st.write_text(json.dumps(m))
    with caplog.at_level(logging.WARNING, logger="tether"):
        t = Trainer(
            small_cfg(f"actor.model={model_dir}", "trainer.total_steps=1", "trainer.val_freq=0", "trainer.report=false")
        )
    assert t.tok.pad_token_id == t.tok.eos_token_id
    assert any("no pad token" in r.getMessage() and "no_pad" in r.getMessage() for r in caplog.records)


def test_empty_dataset_fails_before_training(small_cfg, tmp_path):
    f = tmp_path / "empty.jsonl"
    f.write_text("")
    with pytest.raises(DataError, match="empty"):
        Trainer(small_cfg(f"data.train_files={f}"))


def test_row_without_prompt_names_its_line(small_cfg, tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text(
        json.dumps({"prompt": "3,13=", "data_source": "tether/digitsum", "reward_model": {"ground_truth": "3,13"}})
        + "\n"
        + json.dumps({"data_source": "tether/digitsum"})
        + "\n"
    )
    with pytest.raises(DataError, match=r"bad.jsonl.*line 2"):
        Trainer(small_cfg(f"data.train_files={f}"))


def test_overlong_prompt_is_an_error_naming_the_row(small_cfg):
    with pytest.raises(ConfigError, match=r"longer than data.max_prompt_length=3: record 1 \(\d+ tokens\)"):
        Trainer(small_cfg("data.max_prompt_length=3"))


def test_unknown_data_source_fails_before_training(small_cfg, tmp_path):
    f = tmp_path / "odd.jsonl"
    f.write_text(json.dumps({"prompt": "3,13=", "data_source": "nobody/knows"}) + "\n")
    with pytest.raises(ValueError, match="nobody/knows"):
        Trainer(small_cfg(f"data.train_files={f}", "data.val_files=null"))


REWARD_FILE = """
import math

CALLS = {"n": 0}


def flaky(data_sources, solution_strs, ground_truths, extra_infos):
    out = []
    for s in solution_strs:
        if s.startswith("1"):
            raise RuntimeError("cannot score " + s)
        if s.startswith("2"):
            out.append(float("nan"))
        elif s.startswith("3"):
            out.append("not a number")
        else:
            out.append(1.0 if len(s) == 3 else 0.0)
    return out
"""


@pytest.mark.slow
def test_reward_function_that_raises_or_returns_nan_drops_and_counts(small_cfg, tmp_path):
    f = tmp_path / "flaky.py"
    f.write_text(REWARD_FILE)
    t = Trainer(
        small_cfg(
            f"reward.function={f}:flaky",
            "trainer.total_steps=2",
            "trainer.val_freq=0",
            "trainer.report=false",
            "data.batch_size=8",
            "rollout.n=8",
        )
    )
    history = t.fit()
    for rec in history:
        assert math.isfinite(rec["reward/score_mean"])
        assert rec["reward/invalid_count"] == rec["rollout/dropped_count"]  # an empty response is scored, kept
    total_invalid = sum(r["reward/invalid_count"] for r in history)
    assert total_invalid > 0, "the policy starts with digits 1-3 often; some samples must have been invalid"
    assert all(torch.isfinite(p).all() for p in t.roles.actor.model.parameters())
    errors = sum(r.get("reward/error_count", 0) for r in history)
    nonfinite = sum(r.get("reward/nonfinite_count", 0) for r in history)
    assert errors > 0 and nonfinite > 0, (errors, nonfinite)


def test_empty_responses_are_scored_trained_on_and_counted(small_cfg):
    """An empty response (EOS at once) is an action: the reward scores it (the digit-sum rule: 0) and it stays in the
    batch. Dropped, it would carry no reward, no KL and no gradient, and the policy could move mass onto it for free."""
    t = Trainer(small_cfg("trainer.total_steps=1", "trainer.val_freq=0", "trainer.report=false"))
    batch = t.rollout()
    eos = t.tok.eos_token_id
    batch.response_ids[:3] = t.tok.pad_token_id
    batch.response_ids[:3, 0] = eos  # three responses that end at once: empty text
    from tether.rollout import response_mask_from_ids

    batch.response_mask = response_mask_from_ids(batch.response_ids, eos)
    batch.responses = t.tok.batch_decode(
        torch.where(batch.response_mask.bool(), batch.response_ids, t.tok.pad_token_id), skip_special_tokens=True
    )
    assert batch.responses[:3] == ["", "", ""]
    t.score(batch)
    assert batch.extra["reward_metrics"]["rollout/empty_count"] == 3.0
    assert batch.response_mask[:3].sum(-1).tolist() == [1, 1, 1]  # the EOS token counts: its log-prob is trained
    assert batch.scores[:3].tolist() == [0.0, 0.0, 0.0]  # the digit-sum reward of "" (wrong, not invalid)
    assert batch.response_mask[3:].sum(-1).min() >= 1


def test_two_runs_in_the_same_second_get_their_own_directories(tmp_path, monkeypatch):
    from tether.trainer.trainer import claim_run_dir

    monkeypatch.setattr("time.strftime", lambda fmt: "20261130-120000")
    a, claimed_a = claim_run_dir(None, str(tmp_path / "runs/{time}"))
    b, claimed_b = claim_run_dir(None, str(tmp_path / "runs/{time}"))
    assert (a.name, b.name) == ("20261130-120000", "20261130-120000-1") and claimed_a and claimed_b
    fixed, claimed = claim_run_dir(None, str(tmp_path / "runs/fixed"))
    again, claimed_again = claim_run_dir(None, str(tmp_path / "runs/fixed"))  # a fixed dir is reused: resume
    assert fixed == again and claimed and not claimed_again


def test_an_output_dir_that_cannot_be_written_is_refused_before_anything_loads(tmp_path, monkeypatch):
    """A read-only mount (or a full disk) under trainer.output_dir: refused when the directory is
    claimed, naming the key and the OS's reason, not after the models load and Ray starts (the
    first real write, config.yaml, comes after setup). Root writes through chmod, so the OS's
    refusal is simulated."""
    from tether.trainer.trainer import claim_run_dir

    real = Path.write_bytes

    def read_only(self, data):
        if self.name == ".tether-write-probe":
            raise OSError(30, "Read-only file system")
        return real(self, data)

    monkeypatch.setattr(Path, "write_bytes", read_only)
    with pytest.raises(ConfigError, match=r"trainer.output_dir='.*ro': cannot write into .*ro: Read-only file system"):
        claim_run_dir(None, str(tmp_path / "ro"))
    with pytest.raises(ConfigError, match=r"cannot write into .*runs/2.*: Read-only file system"):
        claim_run_dir(None, str(tmp_path / "runs/{time}"))
    monkeypatch.setattr(Path, "write_bytes", real)
    path, _ = claim_run_dir(None, str(tmp_path / "rw"))
    assert list(path.iterdir()) == []  # the probe leaves nothing behind


def test_a_non_empty_directory_that_is_not_a_run_is_refused(tmp_path):
    from tether.trainer.trainer import claim_run_dir

    user = tmp_path / "userdir"
    user.mkdir()
    (user / "notes.txt").write_text("mine")
    (user / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(
        ConfigError,
        match=r"userdir' holds files but is not a tether run .*: metrics.jsonl, notes.txt\. A run would overwrite them",
    ):
        claim_run_dir(None, str(user))
    assert (user / "metrics.jsonl").read_text() == '{"step": 1}\n'
    # a run's directory (config.yaml or checkpoints/) is reused: resume
    (user / "config.yaml").write_text("{}\n")
    assert claim_run_dir(None, str(user)) == (user, False)
    ck = tmp_path / "ck"
    (ck / "checkpoints").mkdir(parents=True)
    (ck / "metrics.jsonl").write_text("")
    assert claim_run_dir(None, str(ck)) == (ck, False)
    # an empty directory, dotfiles and the sweep's train.log are fine
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / ".keep").write_text("")
    (empty / "train.log").write_text("")
    assert claim_run_dir(None, str(empty)) == (empty, False)


def test_a_failed_start_leaves_an_existing_run_untouched(small_cfg, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("kl:\n  coef: 0.05\n")
    with pytest.raises(DataError):
        Trainer(small_cfg("kl.coef=0.9", f"data.train_files={tmp_path / 'missing.jsonl'}", out=run))
    assert (run / "config.yaml").read_text() == "kl:\n  coef: 0.05\n"
    fresh = tmp_path / "runs"
    with pytest.raises(DataError):
        Trainer(small_cfg(f"data.train_files={tmp_path / 'missing.jsonl'}", out=str(fresh / "{time}")))
    assert not fresh.exists() or not any(fresh.iterdir()), "a failed start left an empty run directory"


def test_a_reference_with_another_tokenizer_is_refused(small_cfg, tmp_path):
    from tether.testing import build_gsm8k_tokenizer, build_tiny_causal_lm, synthetic_math_texts

    tok = build_gsm8k_tokenizer(tmp_path / "tok", texts=synthetic_math_texts(100), vocab_size=300)
    other = build_tiny_causal_lm(tmp_path / "other", tok, arch="llama")
    with pytest.raises(
        ConfigError,
        match=r"ref.model=.*other.* has a different tokenizer from actor.model \(vocabulary \d+ vs 15 tokens",
    ):
        Trainer(small_cfg(f"ref.model={other}"))
    with pytest.raises(ConfigError, match=r"critic.model=.*has a different tokenizer"):
        Trainer(small_cfg(f"critic.model={other}", "algo.adv_estimator=gae"))


def test_model_dir_with_truncated_weights(small_cfg, tmp_path):
    bad = tmp_path / "trunc"
    shutil.copytree(default_reference_path(), bad)
    with open(bad / "model.safetensors", "r+b") as f:
        f.truncate(100)
    with pytest.raises(ConfigError, match=r"cannot load a causal LM from .*trunc: SafetensorError"):
        Trainer(small_cfg(f"actor.model={bad}"))


def test_overlong_prompt_names_its_1_based_file_line(small_cfg, tmp_path):
    # Regression: an overlong prompt was "row 1" (0-based, blank lines not counted) while a malformed
    # row of the same file is "line N"; this one is on line 3 (line 2 is blank).
    ok = json.dumps({"prompt": "3,13=", "data_source": "tether/digitsum", "reward_model": {"ground_truth": "3,13"}})
    long = json.dumps(
        {"prompt": "3,13=" * 20, "data_source": "tether/digitsum", "reward_model": {"ground_truth": "3,13"}}
    )
    f = tmp_path / "long.jsonl"
    f.write_text(ok + "\n\n" + long + "\n")
    with pytest.raises(
        ConfigError,
        match=r"data.train_files: 1 prompt\(s\) longer than data.max_prompt_length=10: line 3 \(\d+ tokens\)",
    ):
        Trainer(small_cfg(f"data.train_files={f}", "data.val_files=null", "data.max_prompt_length=10"))


def test_a_prompt_the_tokenizer_cannot_encode_names_its_row(small_cfg, tmp_path):
    f = tmp_path / "chars.jsonl"
    f.write_text(
        json.dumps({"prompt": "3,13=", "data_source": "tether/digitsum", "reward_model": {"ground_truth": "3,13"}})
        + "\n"
        + json.dumps({"prompt": "3,1x=", "data_source": "tether/digitsum", "reward_model": {"ground_truth": "3,1"}})
        + "\n"
    )
    with pytest.raises(ConfigError, match=r"data.train_files: line 2 \('3,1x='\) cannot be tokenized"):
        Trainer(small_cfg(f"data.train_files={f}", "data.val_files=null"))


def test_resume_off_on_an_earlier_run_is_refused_before_anything_changes(small_cfg, tmp_path, monkeypatch):
    # the trial: resume=off rewrote metrics.jsonl but left step_000020, which a later auto resume picked
    import tether.trainer.trainer as trainer_module

    run = tmp_path / "run"
    (run / "checkpoints" / "step_000020").mkdir(parents=True)
    (run / "config.yaml").write_text("kl:\n  coef: 0.05\n")
    (run / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    monkeypatch.setattr(trainer_module, "build_roles", lambda cfg: pytest.fail("models loaded before the refusal"))
    with pytest.raises(
        ConfigError,
        match=r"^trainer.resume=off: trainer.output_dir='.*run' holds an earlier run \(1 checkpoint\(s\) "
        r"\(step_000020\) and metrics.jsonl with 2 line\(s\)\); a fresh start would mix with it\. Choose a new "
        r"trainer.output_dir, delete '.*run' to start over there, or continue it with trainer.resume=auto$",
    ):
        Trainer(small_cfg("trainer.resume=off", out=run))
    assert (run / "metrics.jsonl").read_text() == '{"step": 1}\n{"step": 2}\n'
    assert (run / "config.yaml").read_text() == "kl:\n  coef: 0.05\n"
    (run / "checkpoints" / "step_000020").rmdir()
    with pytest.raises(ConfigError, match=r"holds an earlier run \(metrics.jsonl with 2 line\(s\)\)"):
        Trainer(small_cfg("trainer.resume=off", out=run))


def test_resume_off_on_a_run_dir_without_checkpoints_or_metrics_starts(tmp_path):
    from tether.trainer.state import check_fresh_start

    run = tmp_path / "run"
    (run / "checkpoints" / ".tmp-step_000002").mkdir(parents=True)  # an interrupted first write only
    (run / "config.yaml").write_text("{}\n")
    (run / "metrics.jsonl").write_text("\n")
    check_fresh_start(run, "off")
    (run / "checkpoints" / "step_000002").mkdir()
    check_fresh_start(run, "auto")  # auto resumes it: nothing to refuse
    with pytest.raises(ConfigError, match=r"1 checkpoint\(s\) \(step_000002\)"):
        check_fresh_start(run, "off")


def test_resuming_a_run_of_another_model_is_one_line(small_cfg, tmp_path):
    # the trial: a size-mismatch dump of the state_dict; the config diff names the cause
    from tether.checkpoint import CheckpointError
    from tether.tasks.sft import build_reference

    narrow = build_reference(
        tmp_path / "narrow", steps=1, batch_size=4, model_config={"hidden_size": 32, "intermediate_size": 64}
    )
    run = tmp_path / "run"
    Trainer(small_cfg(out=run)).ckpt.save(1, {})
    with pytest.raises(CheckpointError) as e:
        Trainer(small_cfg(f"actor.model={narrow}", out=run))
    assert str(e.value) == (
        f"trainer.output_dir={str(run)!r} holds a run of actor.model='embedded' (step_000001), not "
        f"actor.model={str(narrow)!r}: its weights do not fit this model; choose a new trainer.output_dir"
    )
    with pytest.raises(
        CheckpointError,
        match=r"^trainer.resume='.*step_000001' is a checkpoint of a run of actor.model='embedded', not "
        r"actor.model='.*narrow': its weights do not fit this model; choose a new trainer.output_dir or a checkpoint "
        r"of this model$",
    ):
        Trainer(
            small_cfg(
                f"actor.model={narrow}", f"trainer.resume={run / 'checkpoints' / 'step_000001'}", out=tmp_path / "other"
            )
        )


def test_config_diff_on_resume_compares_local_paths_absolute(tmp_path, monkeypatch, caplog):
    from tether.config import load_config
    from tether.trainer.state import CheckpointManager

    (tmp_path / "T" / "qwen").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    m = CheckpointManager.__new__(CheckpointManager)
    m.cfg = load_config(None, [f"actor.model={tmp_path / 'T' / 'qwen'}"])  # e.g. resumed with the run's config.yaml
    # rollout.engine=auto is compared as the engine it resolved to: this run's, and the checkpoint's as recorded
    m.roles = SimpleNamespace(engine=SimpleNamespace(engine=SimpleNamespace(name="hf")))
    saved = load_config(None, ["actor.model=T/qwen"]).to_dict()  # a checkpoint of a start with the relative path
    step1 = tmp_path / "step_000001"
    with caplog.at_level("WARNING", logger="tether"):
        assert m._warn_config_changes(saved, step1, saved_engine="hf") == {}
        assert m._warn_config_changes(load_config(None, ["kl.coef=0.2"]).to_dict(), step1, saved_engine="hf") == {
            "actor.model": ("embedded", str(tmp_path / "T" / "qwen")),
            "kl.coef": (0.2, 0.05),
        }
    assert caplog.text.count("resume: the config differs") == 1
