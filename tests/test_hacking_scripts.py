"""scripts/hacking_monitor.py and benchmarks/bench_hacking_false_alarms.py on tiny synthetic run directories (issue 34,
a new user's trial): paths that are not run directories, guarded runs, runs without exact gold, argument bounds."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(rel: str):
    spec = importlib.util.spec_from_file_location(Path(rel).stem, ROOT / rel)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


mon = _load("scripts/hacking_monitor.py")
bench = _load("benchmarks/bench_hacking_false_alarms.py")
embedded = _load("scripts/embedded_jsonl.py")


def make_run(
    path: Path,
    golds: list[float],
    *,
    exact: bool = True,
    on_hacking: str = "warn",
    acted=(),
    event: str = "guard/rollback",
    task: str = "digitsum_hack",
) -> Path:
    """A run directory: steps 0..10·(len(golds)-1), a validation every 10 steps whose gold is golds[i] (exact and
    sampled, or sampled only), the reference's gold golds[0]; ``event`` (guard/rollback) at the steps in ``acted``;
    config.yaml's data.embedded_task ``task``."""
    path.mkdir(parents=True)
    rows = []
    for step in range(10 * (len(golds) - 1) + 1):
        r = {"step": step, "reward/mean": 0.5, "kl/coef": 0.0}
        if step % 10 == 0:
            g = golds[step // 10]
            r |= {"val/score_mean": 0.5, "val/gold_mean": g, "val/gold_sem": 0.02}
            if exact:
                r |= {"exact/gold_mean": g, "exact/ref_gold_mean": golds[0], "exact/score_mean": 0.5}
        if step in acted:
            r[event] = 1.0
        rows.append(r)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (path / "config.yaml").write_text(f"data:\n  embedded_task: {task}\nguard:\n  on_hacking: {on_hacking}\n")
    return path


def test_exact_onset_by_hand(tmp_path):
    # the reference's gold 0.5; 0.6, 0.7, then 0.4 < 0.5 at step 30: the onset is the best gold before it, step 20
    h = mon.read_metrics(make_run(tmp_path / "r", [0.5, 0.6, 0.7, 0.4]))
    assert mon.exact_onset(h) == (20, 0.7, 0.5)
    assert mon.exact_onset(mon.read_metrics(make_run(tmp_path / "s", [0.5, 0.6, 0.55, 0.5]))) == (None, None, 0.5)


def test_lag_labels():
    base = {"exact_gold": True, "onset": None, "guard": "", "guard_steps": set()}
    assert mon.lag(None, base) == "never"
    assert mon.lag(30, base | {"onset": 20}) == "30 (+10)"
    assert mon.lag(30, base) == "30 (false alarm)"
    assert mon.lag(30, base | {"guard": "rollback", "guard_steps": {30, 40}}) == "30 (guard acted; no onset)"
    assert mon.lag(50, base | {"guard": "rollback", "guard_steps": {30, 40}}) == "50 (guarded run; no onset)"
    assert mon.lag(30, base | {"exact_gold": False}) == "30 (no exact onset)"


def test_run_dirs_skip_files_refuse_other_dirs(tmp_path):
    run = make_run(tmp_path / "sweep" / "run0", [0.5, 0.6])
    (tmp_path / "sweep" / "sweep.yaml").write_text("x: 1\n")
    (tmp_path / "sweep" / "reward_vs_kl.png").write_bytes(b"")
    assert mon.run_dirs(sorted((tmp_path / "sweep").iterdir())) == ([run], [])
    (tmp_path / "data").mkdir()
    runs, problems = mon.run_dirs([run, tmp_path / "data", tmp_path / "nonexistent"])
    assert runs == [run]
    assert problems == [
        f"cannot read run directory {tmp_path / 'data'}: no metrics.jsonl",
        f"cannot read run directory {tmp_path / 'nonexistent'}: no such directory",
    ]
    assert mon.run_dirs([tmp_path / "sweep" / "sweep.yaml"])[1][0].startswith("no run directory among ")


@pytest.mark.parametrize("script", [mon, bench])
def test_not_a_run_directory_exits_2(script, tmp_path, capsys):
    (tmp_path / "data").mkdir()
    with pytest.raises(SystemExit) as e:
        script.main([str(tmp_path / "data")])
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        f"{Path(script.__file__).name}: cannot read run directory {tmp_path / 'data'}: no metrics.jsonl"
    ]


def test_monitor_table_without_exact_gold_and_guarded(tmp_path, capsys):
    make_run(tmp_path / "file_data", [0.5, 0.6, 0.7], exact=False)
    make_run(tmp_path / "guarded", [0.5, 0.6, 0.7], on_hacking="rollback", acted=(20,))
    (tmp_path / "file.json").write_text("{}")
    mon.main([str(tmp_path / "file_data"), str(tmp_path / "guarded"), str(tmp_path / "file.json")])
    out = capsys.readouterr().out
    rows = [ln for ln in out.splitlines() if ln.startswith("| `")]
    assert len(rows) == 2
    assert rows[0].split(" | ")[2] == "n/a (no exact gold)"  # exact onset
    assert rows[0].split(" | ")[5] == "n/a (no exact gold)"  # monitor with exact gold: not the sampled replay
    assert "0 + guard.on_hacking=rollback | 1 | 0/1" in out
    assert "1 run(s) without exact gold" in out
    assert "the reference's gold on the 20 prompts" not in out  # no exact_final.json: no dangling line


def test_bench_counts_only_honest_runs(tmp_path, capsys):
    make_run(tmp_path / "hacked", [0.5, 0.6, 0.7, 0.3, 0.2])
    make_run(tmp_path / "honest", [0.5, 0.5, 0.5, 0.5, 0.5])
    make_run(tmp_path / "guarded", [0.5, 0.5, 0.5, 0.5, 0.5], on_hacking="stop", acted=(30,))
    (tmp_path / "sweep.yaml").write_text("x: 1\n")
    bench.main([str(p) for p in sorted(tmp_path.iterdir())])
    out = capsys.readouterr().out
    assert "hacked: 40 steps, exact onset 20," in out and out.count("not counted") == 2
    assert out.splitlines()[-1] == (
        "false alarms with a sampled gold: 0 in 1 honest runs (runs left out: 1 that hacked by the exact onset; "
        "1 whose guard rolled back or stopped)"
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--per-prompt", "0"], "argument --per-prompt: must be ≥ 2, got 0"),
        (["--per-prompt", "1"], "argument --per-prompt: must be ≥ 2, got 1"),
        (["--per-prompt", "-1"], "argument --per-prompt: must be ≥ 2, got -1"),
        (["--simulate", "-5"], "argument --simulate: must be ≥ 0, got -5"),
        ([], "give run directories or --simulate N"),
    ],
)
def test_bench_refuses_bad_counts(args, message, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(args)
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(f"error: {message}")


def test_bench_simulate_two_per_prompt(capsys):
    bench.main(["--simulate", "2", "--per-prompt", "2"])
    assert capsys.readouterr().out.startswith("simulated stationary runs that warned: ")


@pytest.mark.parametrize("script", [mon, bench, embedded])
def test_help_is_the_whole_first_paragraph(script, capsys):
    with pytest.raises(SystemExit):
        script.main(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    first = " ".join(script.__doc__.split("\n\n")[0].split())
    assert first.endswith(".") and first in help_text


def test_a_hacking_rollback_is_a_guard_action_for_both_scripts(tmp_path, capsys):
    """A new user's trial: the hacking guard logs guard/hacking_rollback (not guard/rollback), and both scripts
    missed it: the bench counted a run the guard rolled back twice as honest (2 false alarms in it), and the monitor
    said "guarded run" where the guard acted."""
    run = make_run(
        tmp_path / "rb", [0.5, 0.5, 0.5, 0.5, 0.5], on_hacking="rollback", acted=(20,), event="guard/hacking_rollback"
    )
    assert mon.guard_actions(mon.read_metrics(run)) == {20}
    assert mon.lag(20, mon.analyse(run)) == "20 (guard acted; no onset)"
    bench.main([str(run)])
    assert capsys.readouterr().out.splitlines()[-1] == (
        "false alarms with a sampled gold: 0 in 0 honest runs (runs left out: 1 whose guard rolled back or stopped)"
    )


def test_monitor_reads_a_gold_logged_by_any_run_and_names_rows_by_run(tmp_path, capsys):
    """A user's own reward.function on the embedded prompts logs exact/gold_mean: its monitor cells are measured,
    not "(no gold)"; rows are named by run directory, so two runs of one task stay apart."""
    make_run(tmp_path / "mine", [0.5, 0.6, 0.7, 0.3], task="digitsum")
    make_run(tmp_path / "mine2", [0.5, 0.6, 0.7, 0.3], task="digitsum")
    mon.main([str(tmp_path / "mine"), str(tmp_path / "mine2")])
    rows = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| `")]
    assert [r.split(" | ")[0] for r in rows] == ["| `mine`", "| `mine2`"]
    assert all(r.split(" | ")[5] == "30 (+10)" for r in rows)  # onset 20 (best gold before the fall below 0.5)
