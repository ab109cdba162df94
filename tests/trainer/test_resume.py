"""Exact resume: a run interrupted after a checkpoint and resumed logs the same metrics as one that was not.

The interruption is simulated in-process: the first trainer's ``fit`` dies with an exception after
some steps (no end-of-run checkpoint, as a crash would leave it); a second trainer on the same
directory resumes with ``trainer.resume=auto``. ``test_faults.py`` does the same with real SIGKILLed
processes.
"""

import json
import logging
import math
import shutil

import pytest
import torch

from tether.checkpoint import CheckpointError
from tether.config import load_config
from tether.trainer import Trainer

pytestmark = pytest.mark.slow

BASE = [
    "trainer.progress=false",
    "trainer.threads=1",
    "trainer.report=false",
    "trainer.loggers=[jsonl]",
    "trainer.seed=3",
    "trainer.total_steps=5",
    "trainer.save_freq=2",
    "trainer.val_freq=2",
    "trainer.val_n=2",
    "trainer.keep_last=5",
    "data.batch_size=4",
    "data.embedded_val_size=2",
    "rollout.n=4",
    "algo.mini_batch_size=8",
    "actor.lr=1e-3",
]
SKIP = ("timing/", "perf/")


def numbers(rec: dict) -> dict:
    return {
        k: v
        for k, v in rec.items()
        if k not in ("step",) and not k.startswith(SKIP) and (v is None or isinstance(v, (int, float)))
    }


def read_lines(run) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def assert_same_metrics(got: list[dict], want: list[dict], tol: float = 1e-6) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for g, w in zip(got, want, strict=True):
        g, w = numbers(g), numbers(w)
        assert g.keys() == w.keys(), g.keys() ^ w.keys()
        for k in w:
            if w[k] is None or g[k] is None:
                assert g[k] is None and w[k] is None, k
            else:
                assert math.isclose(g[k], w[k], rel_tol=0, abs_tol=tol), (k, g[k], w[k])


def cfg(out, *extra):
    return load_config(None, [*BASE, f"trainer.output_dir={out}", *extra])


class Crash(Exception):
    pass


def crash_after(trainer: Trainer, n: int) -> None:
    """Run ``trainer.fit()`` and let it die after step ``n``."""
    step = trainer.train_step

    def train_step():
        if trainer.step >= n:
            raise Crash
        return step()

    trainer.train_step = train_step
    with pytest.raises(Crash):
        trainer.fit()


@pytest.mark.parametrize(
    "extra, stop_after, resume_at, data_pos, rollbacks",
    [
        # 8 prompts / 4 per step: an epoch every 2 steps, so the checkpoint at step 2 is exactly at a boundary
        pytest.param(
            [
                "data.embedded_train_size=8",
                "kl.controller=adaptive",
                "kl.target=0.01",
                "kl.horizon=50",
                "reward.normalize=running",
            ],
            3,
            2,
            {"epoch": 1, "index": 0},
            True,
            id="epoch-boundary-adaptive-running-norm",
        ),
        # 12 prompts: the checkpoint at step 4 is 4 prompts into epoch 1; a critic and its optimizer
        pytest.param(
            [
                "data.embedded_train_size=12",
                "algo.adv_estimator=gae",
                "kl.controller=adaptive",
                "kl.target=0.01",
                "kl.horizon=50",
                "algo.ppo_epochs=2",
            ],
            4,
            4,
            {"epoch": 1, "index": 4},
            False,
            id="mid-epoch-gae-critic",
        ),
        # the reference is moved to the policy every 2 steps: its weights are part of the state
        # rollout correction against a mismatched engine (TIS + rejection) and an off-policy-corrected k3 KL loss over
        # 2 mini-batches
        pytest.param(
            [
                "data.embedded_train_size=8",
                "rollout.engine_temperature=1.5",
                "algo.rollout_correction.level=token",
                "algo.rollout_correction.reject=seq_mean_k3",
                "algo.rollout_correction.reject_threshold=0.05",
                "kl.placement=both",
                "kl.loss_estimator=k3",
                "algo.mini_batch_size=8",
            ],
            3,
            2,
            {"epoch": 1, "index": 0},
            False,
            id="rollout-correction",
        ),
        pytest.param(
            [
                "data.embedded_train_size=8",
                "ref.reset_every=3",
                "kl.placement=both",
                "kl.loss_estimator=k3",
                "kl.controller=band",
                "kl.high=0.02",
                "kl.low=0.005",
            ],
            4,
            4,
            {"epoch": 2, "index": 0},
            True,
            id="ref-reset-band",
        ),
    ],
)
def test_interrupted_and_resumed_equals_uninterrupted(tmp_path, extra, stop_after, resume_at, data_pos, rollbacks):
    full = Trainer(cfg(tmp_path / "full", *extra))
    full.fit()
    want = read_lines(tmp_path / "full")
    assert [r["step"] for r in want if r["step"] > 0] == [1, 2, 3, 4, 5]

    run = tmp_path / "run"
    crash_after(Trainer(cfg(run, *extra)), stop_after)
    assert max(r["step"] for r in read_lines(run)) == stop_after
    # A crash between the checkpoint and its metrics line, and a half-written last line.
    lines = [x for x in (run / "metrics.jsonl").read_text().splitlines() if json.loads(x)["step"] < resume_at]
    (run / "metrics.jsonl").write_text("".join(x + "\n" for x in lines) + '{"step": 9, "kl/ref_')

    state = json.loads((run / "checkpoints" / f"step_{resume_at:06d}" / "trainer_state.json").read_text())
    assert {k: state["data"][k] for k in ("epoch", "index")} == data_pos
    resumed = Trainer(cfg(run, *extra))
    assert resumed.step == resume_at
    resumed.fit()

    got = read_lines(run)  # every step exactly once, the checkpoint's own line restored from the checkpoint
    assert_same_metrics(got, want)
    if "kl.controller=adaptive" in extra or "kl.controller=band" in extra:
        betas = [r["kl/coef"] for r in want if r["step"] > 0]
        assert len(set(betas)) >= 3, betas  # β moved, so matching it means its state was restored
    for a, b in zip(
        full.roles.actor.model.state_dict().values(), resumed.roles.actor.model.state_dict().values(), strict=True
    ):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    if full.roles.critic is not None:
        for a, b in zip(
            full.roles.critic.model.state_dict().values(), resumed.roles.critic.model.state_dict().values(), strict=True
        ):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    if "ref.reset_every=3" in extra:
        assert (run / "checkpoints" / "step_000004" / "ref.safetensors").is_file()
        for a, b in zip(
            full.roles.ref.model.state_dict().values(), resumed.roles.ref.model.state_dict().values(), strict=True
        ):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert resumed.controller.state_dict() == full.controller.state_dict()
    assert resumed.roles.reward.state_dict() == full.roles.reward.state_dict()
    assert resumed.guard.state_dict() == full.guard.state_dict()
    if rollbacks:  # the tiny model's validation score drops at lr=1e-3: resumed runs roll back exactly alike
        assert full.guard.rollbacks >= 1 and any(r.get("guard/rollback") for r in want)
    assert resumed.sampler.state_dict() == full.sampler.state_dict()
    assert (resumed.diagnostics._calls, resumed.diagnostics.history()) == (
        full.diagnostics._calls,
        full.diagnostics.history(),
    )
    if "algo.rollout_correction.level=token" in extra:  # the correction really weighted and rejected, in every step
        steps = [r for r in want if r["step"] > 0]
        assert all(0 < r["rollout_corr/ess"] < 1 for r in steps) and any(
            r["rollout_corr/rejected_frac"] > 0 for r in steps
        )
    if "reward.normalize=running" in extra:
        assert state["reward"]["running"]["count"] == 32  # 2 steps x 16 valid samples went into the normaliser


def test_resume_continues_a_longer_run(tmp_path):
    """The README workflow: train 4 steps, then ask for 6 in the same directory."""
    extra = ["data.embedded_train_size=8", "trainer.val_freq=0"]
    full = Trainer(cfg(tmp_path / "full", *extra, "trainer.total_steps=6"))
    full.fit()
    Trainer(cfg(tmp_path / "run", *extra, "trainer.total_steps=4")).fit()
    second = Trainer(cfg(tmp_path / "run", *extra, "trainer.total_steps=6"))
    assert second.step == 4
    second.fit()
    assert_same_metrics(read_lines(tmp_path / "run"), read_lines(tmp_path / "full"))


def test_auto_falls_back_past_a_corrupt_checkpoint_and_explicit_path_is_an_error(tmp_path, caplog):
    extra = ["data.embedded_train_size=8", "trainer.val_freq=0", "trainer.total_steps=4"]
    Trainer(cfg(tmp_path / "full", *extra)).fit()
    run = tmp_path / "run"
    shutil.copytree(tmp_path / "full", run)
    f = run / "checkpoints" / "step_000004" / "actor" / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])

    with pytest.raises(
        CheckpointError, match=r"step_000004: file actor/model\.safetensors has \d+ bytes, expected \d+ \(truncated\?\)"
    ):
        Trainer(cfg(run, *extra, f"trainer.resume={run / 'checkpoints' / 'step_000004'}"))

    t = Trainer(cfg(run, *extra))
    assert t.step == 2
    assert "actor/model.safetensors" in caplog.text and "falling back to step_000002" in caplog.text
    t.fit()
    assert_same_metrics(read_lines(run), read_lines(tmp_path / "full"))

    for step in (2, 4):  # every checkpoint broken: auto refuses to silently start over
        (run / "checkpoints" / f"step_{step:06d}" / "rng.json").write_text("{}")
    with pytest.raises(
        CheckpointError, match=r"no complete checkpoint.*step_000004: file rng\.json.*step_000002: file rng\.json"
    ):
        Trainer(cfg(run, *extra))


def test_resume_warns_about_a_changed_config(tmp_path, caplog):
    extra = ["data.embedded_train_size=8", "trainer.val_freq=0", "trainer.total_steps=2"]
    Trainer(cfg(tmp_path / "run", *extra)).fit()
    Trainer(cfg(tmp_path / "run", *extra, "trainer.total_steps=3"))
    assert "config differs" not in caplog.text  # total_steps may change freely
    Trainer(cfg(tmp_path / "run", *extra, "trainer.total_steps=3", "kl.coef=0.2"))
    assert "config differs" in caplog.text and "kl.coef: 0.05 → 0.2" in caplog.text


def test_resume_past_total_steps_says_nothing_was_trained(tmp_path, caplog):
    extra = ["data.embedded_train_size=8", "trainer.val_freq=0", "trainer.total_steps=2"]
    Trainer(cfg(tmp_path / "run", *extra)).fit()
    caplog.clear()
    again = Trainer(cfg(tmp_path / "run", *extra, "trainer.total_steps=1"))
    assert again.fit() == [] and again.step == 2
    assert "nothing to train: the run is already at step 2 >= trainer.total_steps=1" in caplog.text


def test_crash_before_the_first_checkpoint_starts_over_cleanly(tmp_path, monkeypatch):
    import tether.trainer.trainer as trainer_module  # the loop calls validate through its module

    def validate(cfg, roles, val_set, **kw):  # cheap, and tagged by the weights it validates
        return {"val/score_mean": float(sum(p.double().sum() for p in roles.actor.model.parameters()))}

    monkeypatch.setattr(trainer_module, "validate", validate)
    extra = ["data.embedded_train_size=8", "trainer.total_steps=3", "trainer.save_freq=3", "trainer.val_freq=1"]
    Trainer(cfg(tmp_path / "full", *extra)).fit()
    crash_after(Trainer(cfg(tmp_path / "run", *extra)), 2)
    assert not (tmp_path / "run" / "checkpoints").exists() or not any((tmp_path / "run" / "checkpoints").iterdir())
    again = Trainer(cfg(tmp_path / "run", *extra))
    assert again.step == 0
    again.fit()
    want = read_lines(tmp_path / "full")
    assert [r["step"] for r in want] in ([0, 1, 2, 3], [1, 2, 3])  # step 0: the reference's validation, if logged
    assert_same_metrics(read_lines(tmp_path / "run"), want)


def test_dynamic_sampling_resumes_exactly(tmp_path):
    """algo.filter_groups draws a varying number of prompts per step; the sampler's position covers them all."""
    extra = ["data.embedded_train_size=12", "rollout.n=2", "algo.filter_groups=true", "algo.filter_groups_max_draws=4"]
    full = Trainer(cfg(tmp_path / "full", *extra))
    full.fit()
    want = read_lines(tmp_path / "full")
    assert any(r.get("rollout/draws", 0) > 1 for r in want if r["step"] <= 2)  # extra draws before the checkpoint
    run = tmp_path / "run"
    crash_after(Trainer(cfg(run, *extra)), 3)
    state = json.loads((run / "checkpoints" / "step_000002" / "trainer_state.json").read_text())
    drawn = sum(r["rollout/prompts_drawn"] for r in want if 1 <= r["step"] <= 2)
    assert state["data"]["epoch"] * 12 + state["data"]["index"] == drawn
    resumed = Trainer(cfg(run, *extra))
    assert resumed.step == 2
    resumed.fit()
    assert_same_metrics(read_lines(run), want)
    assert resumed.sampler.state_dict() == full.sampler.state_dict()


RESUMED = ["data.embedded_train_size=8", "trainer.val_freq=0", "trainer.total_steps=2"]


def _saved_state(run, step: int) -> dict:
    return json.loads((run / "checkpoints" / f"step_{step:06d}" / "trainer_state.json").read_text())


def test_resume_applies_a_changed_fixed_kl_coef_and_says_so(tmp_path, caplog):
    """kl.controller=fixed: β is kl.coef, so a new kl.coef on resume is the β of the steps that follow (an info line
    says old → new); before, config.yaml said 0.2 while the checkpoint's 0.05 went on."""
    run = tmp_path / "run"
    Trainer(cfg(run, *RESUMED)).fit()
    assert _saved_state(run, 2)["controller"]["value"] == 0.05
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tether"):
        t = Trainer(cfg(run, *RESUMED, "trainer.total_steps=3", "kl.coef=0.2"))
    assert "resume: kl.coef 0.05 → 0.2 applied (kl.controller=fixed: β is kl.coef from the next step)" in caplog.text
    assert t.beta == 0.2
    t.fit()
    assert read_lines(run)[-1]["step"] == 3 and read_lines(run)[-1]["kl/coef"] == 0.2


def test_resume_says_a_changed_kl_coef_of_a_moving_controller_is_not_applied(tmp_path, caplog):
    """kl.controller=adaptive: kl.coef is only β's starting value; the resumed run goes on from the checkpoint's β,
    and a warning says so."""
    run = tmp_path / "run"
    extra = [*RESUMED, "kl.controller=adaptive", "kl.horizon=10"]
    Trainer(cfg(run, *extra)).fit()
    saved = _saved_state(run, 2)["controller"]["value"]
    assert saved != 0.05  # it moved
    caplog.clear()
    t = Trainer(cfg(run, *extra, "kl.coef=0.2"))
    assert t.controller.value == saved
    assert (
        f"resume: kl.coef 0.05 → 0.2 is not applied: with kl.controller=adaptive it is only β's starting value, and "
        f"the run goes on from the checkpoint's β={saved:g}"
    ) in caplog.text


def test_resume_of_gae_as_grpo_says_the_critic_is_dropped_and_grpo_to_gae_is_refused(tmp_path, caplog):
    run = tmp_path / "run"
    Trainer(cfg(run, *RESUMED, "algo.adv_estimator=gae")).fit()
    caplog.clear()
    t = Trainer(cfg(run, *RESUMED, "trainer.total_steps=3", "algo.adv_estimator=grpo"))
    assert t.step == 2 and t.roles.critic is None
    assert (
        "resume: algo.adv_estimator changed gae → grpo: checkpoint step_000002's critic (its value model and its "
        "optimizer state) is dropped; advantages are grpo's from the next step, and this run's checkpoints hold no "
        "critic"
    ) in caplog.text
    t.fit()
    assert not (run / "checkpoints" / "step_000003" / "critic.safetensors").exists()
    with pytest.raises(
        CheckpointError,
        match=r"^resume: checkpoint step_000003 is of a run with algo.adv_estimator=grpo, which has no critic, and "
        r"algo.adv_estimator=gae needs one: resume with algo.adv_estimator=grpo, or start a new run",
    ):
        Trainer(cfg(run, *RESUMED, "trainer.total_steps=4", "algo.adv_estimator=gae"))


def test_resume_does_not_warn_for_checkpoint_settings_or_auto_as_the_engine_it_resolved_to(tmp_path, caplog):
    """trainer.save_freq and trainer.keep_last do not change the training, and rollout.engine=auto ran hf here: none
    of them is a difference that makes the run not match; another engine than the one auto resolved to is."""
    run = tmp_path / "run"
    Trainer(cfg(run, *RESUMED)).fit()
    assert _saved_state(run, 2)["rollout_engine"] == "hf"
    caplog.clear()
    t = Trainer(cfg(run, *RESUMED, "trainer.save_freq=1", "trainer.keep_last=1", "rollout.engine=hf"))
    assert t.step == 2 and "config differs" not in caplog.text
    saved = _saved_state(run, 2)["config"]
    assert saved["rollout"]["engine"] == "auto"
    path = run / "checkpoints" / "step_000002"
    assert t.ckpt._warn_config_changes(saved, path, None) == {}  # a checkpoint from before the engine was recorded
    assert t.ckpt._warn_config_changes(saved, path, "vllm") == {"rollout.engine": ("vllm", "hf")}
    assert "(rollout.engine: 'vllm' → 'hf'); the run will not match" in caplog.text


def test_resume_with_another_kl_controller_starts_it_from_the_checkpoints_beta(tmp_path, caplog):
    """kl.controller changed on resume (issue 33's new-user trial: before, 'state_dict is for controller ...', exit 2):
    an adaptive run resumed as fixed takes kl.coef; a fixed run resumed as adaptive starts from the checkpoint's β
    with a fresh update count; scheduled takes its schedule at the run's step. A warning says which."""
    run = tmp_path / "run"
    Trainer(cfg(run, *RESUMED, "kl.controller=adaptive", "kl.horizon=10")).fit()
    saved = _saved_state(run, 2)["controller"]
    assert saved["name"] == "adaptive" and saved["value"] != 0.05
    caplog.clear()
    t = Trainer(cfg(run, *RESUMED, "trainer.total_steps=3"))
    assert t.controller.name == "fixed" and t.beta == 0.05
    assert (
        "resume: kl.controller adaptive → fixed: the checkpoint's controller state does not carry over" in caplog.text
    )
    assert "β starts at 0.05 (kl.coef: a fixed β)" in caplog.text
    t.fit()
    assert read_lines(run)[-1]["step"] == 3 and read_lines(run)[-1]["kl/coef"] == 0.05

    caplog.clear()
    t = Trainer(cfg(run, *RESUMED, "trainer.total_steps=4", "kl.controller=adaptive", "kl.horizon=10"))
    assert t.controller.name == "adaptive" and t.controller.value == 0.05 and t.controller.n_updates == 0
    assert "kl.controller fixed → adaptive" in caplog.text and "the checkpoint's β" in caplog.text

    caplog.clear()
    stages = "kl.schedule.stages=[[2,0.3],[0,0.01]]"
    t = Trainer(cfg(run, *RESUMED, "trainer.total_steps=5", "kl.controller=scheduled", stages))
    assert t.controller.name == "scheduled" and t.controller.n_updates == 3 and t.controller.value == 0.01
    assert "β starts at 0.01 (kl.schedule at step 3)" in caplog.text
