"""tether train's last lines (issue 33): after `done: RUN_DIR`, the final exact success (the reference's beside it),
the KL per token, and where report/summary.md is."""

import json

from tether.cli import main, train_summary


def write(run, records, report=True):
    run.mkdir(parents=True, exist_ok=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if report:
        (run / "report").mkdir()
        (run / "report" / "summary.md").write_text("# run\n")


def test_the_summary_quotes_the_last_validation_and_the_report(tmp_path):
    run = tmp_path / "run"
    write(
        run,
        [
            {"step": 0, "exact/score_mean": 0.4694, "exact/kl_ref_tok": 0.0},
            {"step": 1, "kl/ref_mean": 0.01},
            {"step": 300, "kl/ref_mean": 0.14, "exact/score_mean": 0.8967, "exact/kl_ref_tok": 0.1530},
        ],
    )
    assert train_summary(run) == (
        f"step 300: exact success 0.897 (reference 0.469); KL 0.153 nats/token; report: {run / 'report' / 'summary.md'}"
    )
    other = tmp_path / "other"  # a run on data files: the sampled score and the last batch's KL, no report
    write(
        other, [{"step": 0, "val/score_mean": 0.25}, {"step": 2, "val/score_mean": 0.5, "kl/ref_mean": 0.0625}], False
    )
    assert (
        train_summary(other)
        == "step 2: validation score 0.500 (reference 0.250); KL 0.062 nats/token (last training batch)"
    )
    assert train_summary(tmp_path / "missing") == ""


def test_tether_train_ends_with_the_summary(tmp_path, capsys):
    out = tmp_path / "run"
    small = ["trainer.total_steps=2", "trainer.val_freq=2", "trainer.progress=false", "trainer.threads=1"]
    small += ["data.batch_size=4", "data.embedded_train_size=8", "data.embedded_val_size=4", "rollout.n=4"]
    assert main(["train", *small, "algo.mini_batch_size=8", f"trainer.output_dir={out}"]) == 0
    err = capsys.readouterr().err.splitlines()
    final = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()][-1]
    assert err[-2] == f"done: {out}"
    assert err[-1].startswith(f"  step 2: exact success {final['exact/score_mean']:.3f} (reference ")
    assert err[-1].endswith(f"KL {final['exact/kl_ref_tok']:.3f} nats/token; report: {out / 'report' / 'summary.md'}")


def test_with_a_gold_the_success_is_the_gold_and_the_training_reward_is_labelled(tmp_path):
    # reward.function=tether.tasks.hacks:short_any kl.coef=0: the proxy's exact mean rose while the gold fell to 0
    run = tmp_path / "run"
    write(
        run,
        [
            {"step": 0, "exact/score_mean": 0.5634, "exact/gold_mean": 0.4694, "exact/kl_ref_tok": 0.0},
            {"step": 30, "exact/score_mean": 1.2981, "exact/gold_mean": 0.0, "exact/kl_ref_tok": 2.5},
        ],
        report=False,
    )
    assert train_summary(run) == (
        "step 30: exact success (gold) 0.000 (reference 0.469); exact training reward 1.298 (reference 0.563); "
        "KL 2.500 nats/token"
    )


def test_the_report_summary_lists_the_gold(tmp_path):
    from tether.report import _summary

    history = [{"step": 0, "exact/gold_mean": 0.5}, {"step": 10, "exact/gold_mean": 0.125}]
    assert "| `exact/gold_mean` | 0.5 | 0.125 | 0.125 | 0.5 |" in _summary(tmp_path, history)


def test_a_rollback_at_the_last_validation_quotes_the_restored_weights(tmp_path):
    # issue 34: reward.function=tether.tasks.hacks:short_close reward.val_function=tether.tasks.digitsum:compute_score
    # kl.coef=0 guard.on_hacking=rollback guard.rollback_metric=gold trainer.save_freq=10, seed 0: step 60's gold fell,
    # the guard restored step 50, and the run ended on step 50's weights (the step-60 checkpoint holds them)
    run = tmp_path / "run"
    records = [
        {"step": 0, "exact/score_mean": 0.5014, "exact/gold_mean": 0.4694, "exact/kl_ref_tok": 0.0},
        {"step": 30, "exact/score_mean": 0.8924, "exact/gold_mean": 0.4838, "exact/kl_ref_tok": 0.3},  # rolled back
        {"step": 50, "exact/score_mean": 0.8166, "exact/gold_mean": 0.6922, "exact/kl_ref_tok": 0.1566},
        {"step": 60, "exact/score_mean": 0.8383, "exact/gold_mean": 0.6329, "exact/kl_ref_tok": 0.2110},
    ]
    write(run, records, report=False)
    tried = [[30, 20, 0.05], [40, 20, 0.05], [60, 50, 0.05]]
    assert train_summary(run, tried) == (
        "step 60: rolled back to step 50's weights: exact success (gold) 0.692 (reference 0.469); "
        "exact training reward 0.817 (reference 0.501); KL 0.157 nats/token; 3 rollbacks by the guard, β 0.05 after "
        "the last"
    )
    # a rollback at an earlier validation (step 30) leaves the last one (step 60) to be quoted as it is
    assert train_summary(run, tried[:2]) == (
        "step 60: exact success (gold) 0.633 (reference 0.469); exact training reward 0.838 (reference 0.501); "
        "KL 0.211 nats/token; 2 rollbacks by the guard, β 0.05 after the last"
    )
    # back to the reference's own weights (step 0): its validation, with no reference beside itself
    assert train_summary(run, [[60, 0, 0.05]]) == (
        "step 60: rolled back to step 0's weights: exact success (gold) 0.469; exact training reward 0.501; "
        "KL 0.000 nats/token; 1 rollback by the guard, β 0.05 after the last"
    )
    # a restored checkpoint with no validation in metrics.jsonl: the line says so and quotes nothing of step 60's
    assert (
        train_summary(run, [[60, 40, 0.05]])
        == "step 60: rolled back to step 40's weights (no validation of them logged); 1 rollback by the guard, β 0.05 "
        "after the last"
    )


def test_on_data_files_a_sampled_gold_sits_beside_the_validation_score(tmp_path):
    # a run on data files with reward.val_function: val/gold_mean (sampled) beside the proxy's val/score_mean
    run = tmp_path / "run"
    records = [
        {"step": 0, "val/score_mean": 0.5105, "val/gold_mean": 0.4824},
        {"step": 50, "val/score_mean": 0.8101, "val/gold_mean": 0.6904, "kl/ref_mean": 0.125},
        {"step": 59, "kl/ref_mean": 0.25},
        {"step": 60, "val/score_mean": 0.8218, "val/gold_mean": 0.6191, "kl/ref_mean": 0.375},
    ]
    write(run, records, report=False)
    assert train_summary(run) == (  # no config.yaml: the gold is not named
        "step 60: validation score 0.822 (reference 0.510), gold 0.619 (reference 0.482); "
        "KL 0.375 nats/token (last training batch)"
    )
    (run / "config.yaml").write_text("reward:\n  val_function: tether.tasks.digitsum:compute_score\n")
    assert train_summary(run).startswith(
        "step 60: validation score 0.822 (reference 0.510), gold (reward.val_function) 0.619 (reference 0.482); "
    )
    (run / "config.yaml").write_text("reward:\n  val_function: null\n  val_model: runs/rm\n")
    assert ", gold (reward.val_model) 0.619 " in train_summary(run)
    (run / "config.yaml").write_text("reward:\n  val_function: null\n  val_model: null\n")
    assert ", gold (the data's built-in gold) 0.619 " in train_summary(run)
    # rolled back at step 60 to step 50: step 50's sampled scores and its training batch's KL
    assert train_summary(run, [[60, 50, 0.05]]) == (
        "step 60: rolled back to step 50's weights: validation score 0.810 (reference 0.510), "
        "gold (the data's built-in gold) 0.690 (reference 0.482); KL 0.125 nats/token (step 50's training batch); "
        "1 rollback by the guard, β 0.05 after the last"
    )
