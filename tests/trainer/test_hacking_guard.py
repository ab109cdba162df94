"""guard.on_hacking on the hackable embedded task at β = 0: a rollback that raises β from 0, and a stop."""

import json

import pytest

from tether.config import load_config
from tether.trainer import Trainer
from tether.trainer.guards import TrainingStopped

pytestmark = pytest.mark.slow

# the default run on the hackable task, validated and checkpointed every 10 steps: its gold peaks near step 20 and
# the gold check fires at step 30 (docs/hacking.md)
COMMON = [
    "data.embedded_task=digitsum_hack",
    "kl.coef=0",
    "trainer.total_steps=40",
    "trainer.val_freq=10",
    "trainer.save_freq=10",
    "guard.rollback_drop=0",
    "guard.rollback_metric=gold",
    "trainer.report=false",
    "trainer.progress=false",
    "trainer.threads=1",
]


def test_rollback_restores_a_stable_checkpoint_and_raises_beta_from_zero(tmp_path):
    Trainer(load_config(None, [*COMMON, "guard.on_hacking=rollback", f"trainer.output_dir={tmp_path / 'rb'}"])).fit()
    rows = [json.loads(x) for x in (tmp_path / "rb" / "metrics.jsonl").read_text().splitlines()]
    hits = [r["step"] for r in rows if r.get("guard/hacking_rollback")]  # the warning's step
    assert hits, "the guard never acted"
    after = [r for r in rows if r["step"] > hits[0]]
    assert after and all(r["kl/coef"] >= 0.05 for r in after) and all(r["guard/coef_floor"] == 0.05 for r in after)
    assert all(r["kl/coef"] == 0.0 for r in rows if 0 < r["step"] <= hits[0])


def test_stop_ends_the_run_at_the_warning(tmp_path):
    with pytest.raises(TrainingStopped, match=r"guard.on_hacking=stop"):
        Trainer(load_config(None, [*COMMON, "guard.on_hacking=stop", f"trainer.output_dir={tmp_path / 'st'}"])).fit()
    assert (tmp_path / "st" / "checkpoints").is_dir()
    steps = [json.loads(x)["step"] for x in (tmp_path / "st" / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == len(set(steps))  # the stopped step's line is written once, with guard/stop
    assert json.loads((tmp_path / "st" / "metrics.jsonl").read_text().splitlines()[-1])["guard/hacking"] == 1.0


def test_the_reference_is_a_rollback_target_for_a_hack_from_the_first_update(tmp_path):
    """A flaw exploited from the first update (the held-out ``short_any`` of docs/hacking.md: exact onset at step 0)
    has no checkpoint strictly before it but the reference's weights: under guard.on_hacking=rollback the run
    checkpoints step 0 after its first validation, and that checkpoint is the hacking target of every later step."""
    out = tmp_path / "first"
    cfg = [
        *[c for c in COMMON if not c.startswith(("trainer.total_steps", "trainer.val_freq", "trainer.save_freq"))],
        "trainer.total_steps=2",
        "trainer.val_freq=2",
        "trainer.save_freq=1",
        "guard.on_hacking=rollback",
        f"trainer.output_dir={out}",
    ]
    t = Trainer(load_config(None, cfg))
    t.fit()
    assert (out / "checkpoints" / "step_000000").is_dir()
    assert t.guard.gold_stable_steps[0][0] == 0  # the reference's gold, at step 0
    assert t.guard.hacking_target(1) == 0 and t.guard.hacking_target(0) is None  # strictly before the flagged step
    # without the rollback guard nothing changes: no step-0 checkpoint
    t2 = Trainer(load_config(None, [*cfg[:-2], "guard.on_hacking=warn", f"trainer.output_dir={tmp_path / 'warn'}"]))
    t2.fit()
    assert not (tmp_path / "warn" / "checkpoints" / "step_000000").exists()
