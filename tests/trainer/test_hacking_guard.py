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


def test_a_rollback_at_the_last_step_leaves_the_restored_weights_in_the_last_checkpoint(tmp_path):
    """A new user's trial: a run whose last step rolled back ended on the restored weights (its `done:` line said
    so), but its last checkpoint, written before the doctor looked, held the discarded ones, and `tether export` of
    the run exported them. The last step's checkpoint is now written again after its rollback, without the step's
    record, so a resume from it goes on from the rollback instead of rolling back a second time."""
    from safetensors.torch import load_file

    first = Trainer(load_config(None, [*COMMON, "guard.on_hacking=rollback", f"trainer.output_dir={tmp_path / 'a'}"]))
    first.fit()
    assert first.guard.tried, "the guard never acted"
    last, restored = first.guard.tried[0][:2]  # the first rollback: flagged step → restored step
    # the same run (same seed) ending at the flagged step: its last step rolls back
    out = tmp_path / "b"
    cfg = [*COMMON, "guard.on_hacking=rollback", f"trainer.output_dir={out}"]
    t = Trainer(load_config(None, [*cfg, f"trainer.total_steps={last}"]))
    t.fit()
    assert [r[:2] for r in t.guard.tried] == [[last, restored]]

    def actor(step):
        d = out / "checkpoints" / f"step_{step:06d}" / "actor"
        return {k: v for f in sorted(d.glob("*.safetensors")) for k, v in load_file(f).items()}

    end, back = actor(last), actor(restored)
    assert end.keys() == back.keys() and all(end[k].equal(back[k]) for k in end)
    state = json.loads((out / "checkpoints" / f"step_{last:06d}" / "trainer_state.json").read_text())
    assert state["guard"]["rollbacks"] == 1 and state["metrics"] is None
    # resumed with more steps: no second rollback of the same warning
    t2 = Trainer(load_config(None, [*cfg, f"trainer.total_steps={last + 1}", "trainer.resume=auto"]))
    assert t2.guard.rollbacks == 1 and [r[:2] for r in t2.guard.tried] == [[last, restored]]
