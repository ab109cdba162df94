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
