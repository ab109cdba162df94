"""End-to-end runs of the trainer on the embedded task (tiny model, CPU, seconds each)."""

import json
import math

import pytest
import torch

from tether.trainer import Trainer

pytestmark = pytest.mark.slow

TIMING = ("timing/", "perf/")


def _params(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _finite_numbers(rec):
    return {k: v for k, v in rec.items() if isinstance(v, (int, float))}


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param([], id="grpo-kl-in-reward"),
        pytest.param(
            [
                "algo.adv_estimator=gae",
                "kl.placement=both",
                "kl.loss_estimator=k3+",
                "algo.ppo_epochs=2",
                "algo.mini_batch_size=8",
            ],
            id="ppo-gae-both",
        ),
        pytest.param(
            ["algo.adv_estimator=rloo", "kl.placement=loss", "kl.estimator=low_var_kl", "kl.controller=adaptive"],
            id="rloo-kl-loss",
        ),
        pytest.param(
            ["algo.adv_estimator=reinforce_plus_plus", "kl.estimator=full", "kl.controller=band"], id="rpp-full-kl"
        ),
    ],
)
def test_train_runs_end_to_end(small_cfg, tmp_path, overrides):
    cfg = small_cfg(*overrides)
    trainer = Trainer(cfg)
    before = _params(trainer.roles.actor.model)
    ref_before = _params(trainer.roles.ref.model)
    history = trainer.fit()
    assert len(history) == 3
    after = trainer.roles.actor.model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before), "the actor did not change"
    assert all(torch.equal(ref_before[k], v) for k, v in trainer.roles.ref.model.state_dict().items()), (
        "the reference moved"
    )
    for rec in history:
        for key in (
            "reward/score_mean",
            "kl/ref_mean",
            "kl/coef",
            "policy/entropy",
            "policy/pg_loss",
            "response/length_mean",
            "perf/tokens_per_s",
        ):
            assert math.isfinite(rec[key]), (key, rec[key])
    run = cfg.trainer.output_dir
    from pathlib import Path

    run = Path(run)
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [0, 1, 2, 3]  # step 0: validation of the reference
    assert (run / "config.yaml").is_file()
    assert any((run / "events").iterdir())
    assert (run / "checkpoints" / "step_000003" / "MANIFEST.json").is_file()
    assert (run / "report" / "summary.md").is_file() and (run / "report" / "reward.png").is_file()
    if "algo.adv_estimator=gae" in overrides:
        assert "value/loss" in history[0] and math.isfinite(history[0]["value/loss"])


def test_same_seed_same_metrics(small_cfg, tmp_path):
    runs = []
    for name in ("a", "b"):
        t = Trainer(small_cfg("trainer.total_steps=2", "trainer.report=false", out=tmp_path / name))
        runs.append([{k: v for k, v in _finite_numbers(r).items() if not k.startswith(TIMING)} for r in t.fit()])
    assert runs[0] == runs[1]


@pytest.mark.kernels
def test_default_run_repeats_bitwise_in_fresh_processes(tmp_path):
    """The README's reproducibility claim: `tether train` twice with the same seed, each in its own process, writes
    the same metrics.jsonl, every value bitwise (timing/* and perf/* aside). By construction: the same kernels on
    the same shapes in the same order give the same bits, whatever the CPU or kernel setting (make test-kernels runs
    it under each); the default task and sizes, 20 steps with 2 validations (~10 s a run)."""
    import subprocess
    import sys

    runs = []
    for name in ("a", "b"):
        out = tmp_path / name
        args = ["trainer.total_steps=20", "trainer.val_freq=10", "trainer.save_freq=0", "trainer.report=false"]
        args += ["trainer.progress=false", f"trainer.output_dir={out}"]
        cmd = [sys.executable, "-m", "tether.cli", "train", *args]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        runs.append([{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in lines])
    assert [r["step"] for r in runs[0]] == list(range(21)) and "val/score_mean" in runs[0][20]
    assert runs[0] == runs[1]
