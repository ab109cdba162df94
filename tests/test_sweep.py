"""tether sweep: grid expansion, naming, resumability, the table from fake run directories, a tiny real sweep."""

from __future__ import annotations

import csv
import json
import math
import subprocess
import time

import pytest

from tether import sweep as sw
from tether.checkpoint import write_checkpoint
from tether.cli import main as cli_main
from tether.config import parse_override

# ----------------------------------------------------------------------------------------------
# values, grid, names


def test_split_values_respects_brackets_and_parses_yaml():
    assert sw.split_values("0,0.01,0.05") == [0, 0.01, 0.05]
    assert sw.split_values("fixed,adaptive") == ["fixed", "adaptive"]
    assert sw.split_values("[[50,0.08],[0,0.03]],[[10,0.1]]") == [[[50, 0.08], [0, 0.03]], [[10, 0.1]]]
    assert sw.split_values("true,null,'a,b'") == [True, None, "a,b"]
    with pytest.raises(sw.SweepError, match="unbalanced"):
        sw.split_values("[1,2")
    with pytest.raises(sw.SweepError, match="empty value"):
        sw.split_values("0,,1")


def test_parse_grid_arg():
    assert sw.parse_grid_arg("kl.coef=0,0.05") == ("kl.coef", [0, 0.05])
    with pytest.raises(sw.SweepError, match="key=v1,v2"):
        sw.parse_grid_arg("kl.coef")
    with pytest.raises(sw.SweepError, match="needs a key"):
        sw.parse_grid_arg("kl.coef=")


@pytest.mark.parametrize(
    "value", [0, 0.05, 1e-4, True, None, "fixed", "k3+", [[50, 0.08], [0, 0.03]], "a b", "1.0", "", "off"]
)
def test_format_value_round_trips_through_the_override_parser(value):
    assert parse_override(f"key={sw.format_value(value)}")[1] == value


def test_expand_grid_is_the_cartesian_product_in_order():
    runs = sw.expand_grid({"kl.coef": [0, 0.05], "kl.controller": ["fixed", "adaptive"]}, {"trainer.total_steps": 7})
    assert [r.name for r in runs] == [
        "kl.coef=0__kl.controller=fixed",
        "kl.coef=0__kl.controller=adaptive",
        "kl.coef=0.05__kl.controller=fixed",
        "kl.coef=0.05__kl.controller=adaptive",
    ]
    assert runs[3].overrides == (("kl.coef", 0.05), ("kl.controller", "adaptive"))
    # fixed overrides first, then the sweep's defaults, then the run's own
    assert runs[3].args() == [
        "trainer.total_steps=7",
        "trainer.progress=false",
        "trainer.report=false",
        "kl.coef=0.05",
        "kl.controller=adaptive",
    ]
    assert runs[2].label() == "kl.coef=0.05, kl.controller=fixed"
    assert runs[2].label({"kl.controller": "controller"}) == "kl.coef=0.05, controller=fixed"


def test_plot_labels_name_each_value_s_key():
    # Regression: legends showed "0.05/fixed", not which key each value belongs to.
    runs = sw.expand_grid({"kl.coef": [0, 0.05]}, {"trainer.total_steps": 7})
    assert sw.plot_labels(runs) == {"kl.coef=0": "kl.coef=0", "kl.coef=0.05": "kl.coef=0.05"}
    # long keys: their last two parts, more where two keys would read the same; a key all runs set alike is left out
    runs = sw.expand_grid(
        {"trainer.seed": [0, 1]},
        configs=[
            {"algo.rollout_correction.level": "token", "actor.optim.lr": 1e-3, "rollout.n": 4},
            {"critic.optim.lr": 1e-3, "rollout.n": 4},
        ],
    )
    assert list(sw.plot_labels(runs).values()) == [
        "rollout_correction.level=token, actor.optim.lr=0.001, trainer.seed=0",
        "rollout_correction.level=token, actor.optim.lr=0.001, trainer.seed=1",
        "critic.optim.lr=0.001, trainer.seed=0",
        "critic.optim.lr=0.001, trainer.seed=1",
    ]
    assert sw.plot_labels(sw.expand_grid({"kl.coef": [0.1]})) == {"kl.coef=0.1": "kl.coef=0.1"}
    assert sw.plot_labels(sw.expand_grid({}, {"kl.coef": 0.1})) == {"default": "default"}


def test_expand_grid_configs_times_grid_and_config_keys_win():
    runs = sw.expand_grid(
        {"kl.coef": [0.05, 0.3], "kl.estimator": ["k1"]},
        {"trainer.report": True},
        configs=[{"kl.placement": "loss", "kl.estimator": "k3"}, {"kl.placement": "reward"}],
    )
    assert [r.name for r in runs] == [
        "kl.placement=loss__kl.estimator=k3__kl.coef=0.05",
        "kl.placement=loss__kl.estimator=k3__kl.coef=0.3",
        "kl.placement=reward__kl.coef=0.05__kl.estimator=k1",
        "kl.placement=reward__kl.coef=0.3__kl.estimator=k1",
    ]
    # the config entry's kl.estimator=k3 wins over the grid's k1; a fixed key set in the spec is kept
    assert runs[0].all_overrides == {
        "trainer.report": True,
        "trainer.progress": False,
        "kl.placement": "loss",
        "kl.estimator": "k3",
        "kl.coef": 0.05,
    }


def test_expand_grid_duplicate_names_raise():
    # the config entry fixes kl.coef, so both grid points give the same run
    with pytest.raises(sw.SweepError, match="both named 'kl.coef=0.1'"):
        sw.expand_grid({"kl.coef": [0.05, 0.3]}, configs=[{"kl.coef": 0.1}])
    with pytest.raises(sw.SweepError, match="non-empty list"):
        sw.expand_grid({"kl.coef": []})


def test_output_dir_is_rejected_wherever_it_is_set(tmp_path, capsys):
    for kwargs, where in [
        ({"fixed": {"trainer.output_dir": "x"}}, "fixed overrides"),
        ({"grid": {"trainer.output_dir": ["a", "b"]}}, "grid"),
        ({"configs": [{}, {"trainer.output_dir": "y"}]}, r"configs\[1\]"),
    ]:
        with pytest.raises(
            sw.SweepError,
            match=where + " sets trainer.output_dir, which the sweep owns: each run writes to <out>/<run name>",
        ):
            sw.expand_grid(**kwargs)
    out = tmp_path / "s"
    assert (
        cli_main(
            [
                "sweep",
                "--grid",
                "kl.coef=0,0.05",
                f"trainer.output_dir={tmp_path / 'x'}",
                "--out",
                str(out),
                "--dry-run",
            ]
        )
        == 2
    )
    assert "tether sweep: fixed overrides sets trainer.output_dir, which the sweep owns" in capsys.readouterr().err
    assert not out.exists() and not (tmp_path / "x").exists()


def test_run_name_sanitises_and_hashes_long_names():
    assert sw.run_name([]) == "default"
    assert sw.run_name([("kl.schedule.stages", [[50, 0.08], [0, 0.03]])]) == "kl.schedule.stages=50,-0.08-,-0,-0.03"
    a = [("data.train_files", "/very/long/path/" + "x" * 150 + ".jsonl")]
    b = [("data.train_files", "/very/long/path/" + "x" * 150 + ".parquet")]
    na, nb = sw.run_name(a), sw.run_name(b)
    assert len(na) <= 120 and len(nb) <= 120 and na != nb
    assert "/" not in na


def test_run_name_keeps_the_minus_sign_of_negative_values():
    # Regression: the slug's strip("-") dropped a value's own minus, so -0.01 and 0.01 collided.
    assert sw.run_name([("algo.entropy_coef", -0.01)]) == "algo.entropy_coef=-0.01"
    assert sw.run_name([("kl.coef", -1)]) == "kl.coef=-1"
    assert sw.run_name([("kl.schedule.stages", [[-5, 0.1]])]) == "kl.schedule.stages=-5,-0.1"
    assert sw.run_name([("algo.entropy_coef", -0.01)]) != sw.run_name([("algo.entropy_coef", 0.01)])


def test_load_spec_merges_file_and_command_line(tmp_path):
    p = tmp_path / "s.yaml"
    p.write_text(
        "out: OUT\nworkers: 3\nfixed: {trainer.total_steps: 5}\ngrid: {kl.coef: [0, 0.1], trainer.seed: [0, "
        "1]}\nconfigs:\n  - {kl.controller: fixed}\n"
    )
    spec = sw.load_spec(
        p, grid=["kl.coef=0.3"], fixed=["trainer.total_steps=9", "actor.lr=0.01"], out=None, workers=None
    )
    assert spec.out == "OUT" and spec.workers == 3
    assert dict(spec.grid) == {"kl.coef": [0.3], "trainer.seed": [0, 1]}
    assert dict(spec.fixed) == {"trainer.total_steps": 9, "actor.lr": 0.01}
    assert [r.name for r in spec.runs()] == [
        "kl.controller=fixed__kl.coef=0.3__trainer.seed=0",
        "kl.controller=fixed__kl.coef=0.3__trainer.seed=1",
    ]
    bad = tmp_path / "bad.yaml"
    bad.write_text("gird: {kl.coef: [0]}\n")
    with pytest.raises(sw.SweepError, match="unknown key"):
        sw.load_spec(bad)
    with pytest.raises(sw.SweepError, match="exact_final"):
        sw.load_spec(None, exact_final="some")


@pytest.mark.parametrize("workers", [0, -1, 1.5, "2"])
def test_workers_below_one_or_not_whole_is_an_error(tmp_path, workers):
    # --workers 0 used to fall back silently to one per core, -1 to one
    with pytest.raises(sw.SweepError, match=rf"workers must be a whole number >= 1 .*got {workers!r}"):
        sw.load_spec(None, workers=workers)
    p = tmp_path / "s.yaml"
    p.write_text(f"workers: {workers!r}\n")
    with pytest.raises(sw.SweepError, match="workers must be a whole number >= 1"):
        sw.load_spec(p)


# ----------------------------------------------------------------------------------------------
# resumability


class _FakeRun:
    """Stands in for subprocess.run: records the commands, returns a chosen exit status."""

    def __init__(self, rc=0):
        self.rc, self.calls = rc, []

    def __call__(self, cmd, **kw):
        self.calls.append(cmd)
        return subprocess.CompletedProcess(cmd, self.rc)


def test_finished_config_is_skipped_and_others_resume(tmp_path, monkeypatch):
    fake = _FakeRun(0)
    monkeypatch.setattr(sw.subprocess, "run", fake)
    runs = sw.expand_grid({"kl.coef": [0, 0.05]}, {"trainer.total_steps": 3})
    first = sw.execute_run(runs[0], tmp_path / runs[0].name, threads=1)
    assert first.status == "done" and len(fake.calls) == 1
    cmd = fake.calls[0]
    assert cmd[1:4] == ["-m", "tether.cli", "train"]
    assert (
        f"trainer.output_dir={tmp_path / runs[0].name}" in cmd
        and "trainer.resume=auto" in cmd
        and "trainer.threads=1" in cmd
    )
    marker = json.loads((tmp_path / runs[0].name / sw.DONE_MARKER).read_text())
    assert marker["args"] == runs[0].args() and marker["rc"] == 0
    # the finished run is skipped: no new subprocess
    again = sw.execute_run(runs[0], tmp_path / runs[0].name, threads=1)
    assert again.status == "skipped" and len(fake.calls) == 1
    # the same directory with other overrides (e.g. more steps) is not finished: it runs (and resumes)
    more = sw.expand_grid({"kl.coef": [0]}, {"trainer.total_steps": 6})[0]
    assert more.name == runs[0].name
    assert not sw.is_finished(tmp_path / more.name, more)
    assert sw.execute_run(more, tmp_path / more.name).status == "done" and len(fake.calls) == 2


def test_failed_run_is_not_marked_and_is_retried(tmp_path, monkeypatch):
    fake = _FakeRun(3)
    monkeypatch.setattr(sw.subprocess, "run", fake)
    run = sw.expand_grid({"kl.coef": [0.1]})[0]
    res = sw.execute_run(run, tmp_path / run.name)
    assert res.status == "failed" and res.rc == 3
    assert not (tmp_path / run.name / sw.DONE_MARKER).exists()
    assert sw.execute_run(run, tmp_path / run.name).status == "failed" and len(fake.calls) == 2
    assert "$ " in (tmp_path / run.name / "train.log").read_text()


def test_final_checkpoint_without_marker_counts_as_finished(tmp_path):
    run = sw.expand_grid({"kl.coef": [0.1]}, {"trainer.total_steps": 4})[0]
    d = tmp_path / run.name
    write_checkpoint(d / "checkpoints", 2, {"w": lambda t: (t / "x.bin").write_bytes(b"12")})
    assert not sw.is_finished(d, run)  # only step 2 of 4
    write_checkpoint(d / "checkpoints", 4, {"w": lambda t: (t / "x.bin").write_bytes(b"34")})
    assert sw.is_finished(d, run)
    assert json.loads((d / sw.DONE_MARKER).read_text())["args"] == run.args()


def test_run_sweep_skips_finished_and_counts(tmp_path, monkeypatch):
    fake = _FakeRun(0)
    monkeypatch.setattr(sw.subprocess, "run", fake)
    spec = sw.SweepSpec(grid=[("kl.coef", [0, 0.05, 0.1])], out=str(tmp_path / "sw"), exact_final="none")
    lines = []
    res = sw.run_sweep(spec, workers=2, summarize=False, echo=lines.append)
    assert sorted(r.status for r in res) == ["done"] * 3 and len(fake.calls) == 3
    res = sw.run_sweep(spec, workers=2, summarize=False, echo=lines.append)
    assert [r.status for r in res] == ["skipped"] * 3 and len(fake.calls) == 3
    assert lines[0].startswith("sweep: 3 runs in") and "2 at a time" in lines[0]
    dry = []
    sw.run_sweep(spec, workers=1, dry_run=True, echo=dry.append)
    assert len(dry) == 3 and all(x.startswith("[finished] ") for x in dry)


# ----------------------------------------------------------------------------------------------
# the table from fake run directories


def _fake_run(d, steps, reward, kl, coef, exact_score, collapse=0.0, finished=True, run=None):
    d.mkdir(parents=True)
    with (d / "metrics.jsonl").open("w") as f:
        for s in range(1, steps + 1):
            rec = {
                "step": s,
                "reward/score_mean": reward(s),
                "kl/ref_mean": kl(s),
                "kl/ref_mean_unclamped": kl(s),
                "kl/coef": coef,
                "policy/entropy": 1.0,
                "diversity/unique_frac": 0.5,
                "diversity/collapse_rate": collapse,
            }
            if s % 10 == 0:
                rec |= {
                    "val/score_mean": 0.9,
                    "val/collapse_rate": collapse,
                    "exact/score_mean": exact_score(s),
                    "exact/kl_ref_tok": 0.2,
                    "exact/kl_ref_seq": 0.8,
                    "exact/opt_kl_ref_seq": 0.779,
                    "exact/opt_score_mean": 1.0,
                    "exact/objective": 0.9,
                    "exact/opt_objective": 0.96,
                    "exact/objective_gap": 0.06,
                    "exact/kl_opt_seq": 1.2,
                    "exact/correct_effective_answers": 20.0,
                    "exact/opt_correct_effective_answers": 40.0,
                    "exact/effective_answers": 25.0,
                    "exact/collapse_rate@8": 1e-9,
                    "exact/unique_frac@8": 0.95,
                }
            f.write(json.dumps(rec) + "\n")
    (d / "config.yaml").write_text("rollout: {temperature: 1.0, n: 8}\n")
    if finished:
        sw._write_marker(d, run, 0, 1.0)


def test_table_contents_from_fake_runs(tmp_path):
    runs = sw.expand_grid({"kl.coef": [0, 0.05, 0.1]})
    out = tmp_path / "sweep"
    _fake_run(
        out / runs[0].name, 30, lambda s: s / 100, lambda s: 0.01 * s, 0.0, lambda s: s / 40, collapse=0.5, run=runs[0]
    )
    _fake_run(out / runs[1].name, 40, lambda s: 0.5, lambda s: 0.03, 0.05, lambda s: 0.7, run=runs[1], finished=False)
    rows = sw.summarize_sweep(out, runs, tail=5, exact_final="none", plots=False, echo=lambda *_: None)
    r0, r1, r2 = rows
    assert r0["name"] == "kl.coef=0" and r0["kl.coef"] == "0" and r0["status"] == "finished" and r0["steps"] == 30
    assert r0["reward"] == pytest.approx((26 + 27 + 28 + 29 + 30) / 500)  # mean of the last 5 steps
    assert r0["kl_tok"] == pytest.approx(0.28)
    assert r0["collapse_rate"] == 0.5 and r0["val_collapse_rate"] == 0.5 and r0["beta"] == 0.0
    # the last validation (step 30)
    assert r0["exact_score"] == pytest.approx(0.75) and r0["exact_source"] == "val (log)"
    assert (
        r0["objective_gap"] == pytest.approx(0.06) and r0["exact_collapse"] == 1e-9 and r0["exact_unique_frac"] == 0.95
    )
    assert r0["opt_correct_eff_answers"] == 40.0
    assert r1["status"] == "incomplete" and r1["steps"] == 40 and r1["reward"] == 0.5 and r1["beta"] == 0.05
    assert r2["status"] == "missing" and r2["steps"] == 0 and math.isnan(r2["reward"]) and math.isnan(r2["exact_score"])
    with (out / "table.csv").open() as f:
        table = list(csv.DictReader(f))
    assert [t["name"] for t in table] == [r.name for r in runs]
    assert float(table[0]["reward"]) == pytest.approx(0.28) and table[0]["kl.coef"] == "0"
    md = (out / "table.md").read_text().splitlines()
    assert md[0].startswith("| run | status | β final | reward (train, tail)")
    assert md[2].startswith("| `kl.coef=0` | finished | 0.000 | 0.280 | 0.280 | 0.750 |")
    assert "| `kl.coef=0.1` | missing |" in md[4]


def test_summarize_run_prefers_the_final_exact_evaluation(tmp_path):
    run = sw.expand_grid({"kl.coef": [0.05]})[0]
    _fake_run(tmp_path / run.name, 10, lambda s: 0.5, lambda s: 0.1, 0.05, lambda s: 0.6, run=run)
    row = sw.summarize_run(
        tmp_path / run.name, run, exact={"exact/score_mean": 0.99, "exact/collapse_rate@4": 0.25, "_prompts": "all"}
    )
    assert row["exact_score"] == 0.99 and row["exact_source"] == "all" and row["exact_collapse"] == 0.25
    assert math.isnan(row["exact_kl_tok"])


def test_plots_are_written(tmp_path):
    runs = sw.expand_grid({"kl.coef": [0, 0.05]})
    for r in runs:
        _fake_run(tmp_path / r.name, 10, lambda s: 0.5, lambda s: 0.1, 0.05, lambda s: 0.6, run=r)
    rows = sw.summarize_sweep(tmp_path, runs, exact_final="none", plots=False, echo=lambda *_: None)
    curve = [
        {
            "beta": b,
            "kl_tok": 0.2 / (1 + b),
            "reward": 1 - b / 10,
            "correct_effective_answers": 40.0,
            "unique_frac": 0.9,
        }
        for b in (0.05, 0.3, 1.0)
    ]
    paths = sw.plot_sweep(rows, curve, tmp_path)
    assert [p.name for p in paths] == ["reward_vs_kl.png", "reward_vs_diversity.png"]
    assert all(p.stat().st_size > 5000 for p in paths)


def _close(figs):
    import matplotlib.pyplot as plt

    for fig in figs.values():
        plt.close(fig)


def test_sweep_legends_and_the_hollow_note(tmp_path):
    # Regressions: legends gave bare values ("0.05"); "hollow: sampled" was in the axis labels with no hollow point
    # drawn.
    runs = sw.expand_grid({"kl.coef": [0, 0.05, 0.1]})
    for r in runs[:2]:
        # exact/* logged at step 10
        _fake_run(tmp_path / r.name, 10, lambda s: 0.5, lambda s: 0.1, 0.05, lambda s: 0.6, run=r)
    # sampled columns only
    _fake_run(tmp_path / runs[2].name, 5, lambda s: 0.4, lambda s: 0.2, 0.1, lambda s: 0.6, run=runs[2])
    rows = sw.summarize_sweep(tmp_path, runs, exact_final="none", plots=False, echo=lambda *_: None)
    curve = [
        {
            "beta": b,
            "kl_tok": 0.2 / (1 + b),
            "reward": 1 - b / 10,
            "correct_effective_answers": 40.0,
            "unique_frac": 0.9,
        }
        for b in (0.05, 0.3, 1.0)
    ]
    labels = sw.plot_labels(runs)

    figs = sw.sweep_figures(rows[:2], curve, labels)  # every point exact: no hollow note
    (ax,) = figs["reward_vs_kl"].axes
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["exact optimum π*_β", "kl.coef=0", "kl.coef=0.05"]
    assert ax.get_xlabel() == "KL(π‖π_ref), nats per token (exact)"
    left, right = figs["reward_vs_diversity"].axes
    assert left.get_xlabel().endswith("(exact)") and right.get_xlabel().endswith("(exact)")
    _close(figs)

    figs = sw.sweep_figures(rows, curve, labels)  # the third run is drawn hollow
    (ax,) = figs["reward_vs_kl"].axes
    assert ax.get_xlabel() == "KL(π‖π_ref), nats per token (filled: exact; hollow: sampled)"
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "exact optimum π*_β",
        "kl.coef=0",
        "kl.coef=0.05",
        "kl.coef=0.1",
    ]
    points = {c.get_label(): c for c in ax.collections}
    # hollow, filled
    assert points["kl.coef=0.1"].get_facecolor().size == 0 and points["kl.coef=0"].get_facecolor()[0][3] == 1
    left, right = figs["reward_vs_diversity"].axes
    assert left.get_xlabel().endswith("(exact)")  # this panel has no sampled fallback: the run is not drawn
    assert [c.get_label() for c in left.collections] == ["kl.coef=0", "kl.coef=0.05"]
    assert right.get_xlabel() == "unique fraction among n samples (filled: exact; hollow: sampled)"
    # one legend for both panels, and a run keeps its colour in each
    assert left.get_legend() is None
    assert [t.get_text() for t in right.get_legend().get_texts()] == [
        "exact optimum π*_β",
        "kl.coef=0",
        "kl.coef=0.05",
        "kl.coef=0.1",
    ]
    for c in right.collections:
        assert list(c.get_edgecolor()[0]) == list(points[c.get_label()].get_edgecolor()[0])
    _close(figs)

    figs = sw.sweep_figures(rows[2:], None, labels)  # only sampled points, no curve
    assert figs["reward_vs_kl"].axes[0].get_xlabel() == "KL(π‖π_ref), nats per token (hollow: sampled)"
    assert figs["reward_vs_diversity"].axes[0].get_xlabel() == "distinct correct answers, exp H(π | correct)"
    _close(figs)


def test_curve_beta_labels_do_not_overlap():
    # Regression: β=0.05 and β=0.1 (nearly the same point of the curve) were printed over each other, and on
    # the vertical line of correct answers every label stacked at its right edge, past the axes.
    betas = [0.0, 0.05, 0.1, 0.3, 0.5, 1.0, 2.0, 100.0]
    kl = [0.2, 0.1999, 0.1995, 0.15, 0.1, 0.05, 0.02, 0.0]
    reward = [1.0, 0.9999, 0.999, 0.96, 0.9, 0.75, 0.6, 0.46]
    curve = [
        {"beta": b, "kl_tok": k, "reward": r, "correct_effective_answers": 47.2, "unique_frac": 0.95 - k}
        for b, k, r in zip(betas, kl, reward, strict=True)
    ]
    rows = [
        {"name": "a", "exact_kl_tok": 0.25, "exact_score": 0.9, "correct_eff_answers": 35.0, "exact_unique_frac": 0.9}
    ]
    figs = sw.sweep_figures(rows, curve)
    seen = {}
    for key, fig in figs.items():
        renderer = fig.canvas.get_renderer()
        sep = sw.CURVE_LABEL_SEP * fig.dpi / 72
        for ax in fig.axes:
            notes = [t for t in ax.texts if t.get_text().startswith("β=")]
            seen[key, ax.get_xlabel()] = [t.get_text() for t in notes]
            boxes = [t.get_window_extent(renderer) for t in notes]
            anchors = [ax.transData.transform(t.xy) for t in notes]
            for i in range(len(notes)):
                assert ax.bbox.x0 <= boxes[i].x0 and boxes[i].x1 <= ax.bbox.x1, notes[i].get_text()
                for j in range(i):
                    assert not boxes[i].overlaps(boxes[j]), (notes[i].get_text(), notes[j].get_text())
                    assert math.dist(anchors[i], anchors[j]) >= sep
    assert (
        list(seen.values())
        == [
            ["β=0.05", "β=0.3", "β=0.5", "β=1", "β=2"],  # β=0.1 sits on β=0.05: left out in each panel
        ]
        * 3
    )
    _close(figs)


def test_optimum_curve_matches_the_closed_form():
    prompts = sw.exact_prompts("val")
    assert prompts == ["3,6=", "3,11=", "3,16=", "3,21="]
    lo, hi = sw.optimum_curve(prompts, [0.01, 100.0])
    # β → 0: π_ref conditioned on being correct (reward 1, KL = −log P_ref(correct) ≈ 0.78 nats)
    assert (
        lo["reward"] == pytest.approx(1.0, abs=1e-6)
        and 0.6 < lo["kl_seq"] < 1.0
        and lo["kl_tok"] == pytest.approx(lo["kl_seq"] / 4, rel=0.1)
    )
    # β → ∞: π_ref (reward ≈ 0.46, KL ≈ 0)
    assert 0.4 < hi["reward"] < 0.52 and hi["kl_seq"] < 1e-3
    # conditioning on correctness does not change the spread over correct answers
    assert lo["correct_effective_answers"] == pytest.approx(hi["correct_effective_answers"], rel=1e-6)


# ----------------------------------------------------------------------------------------------
# CLI


def test_cli_dry_run_and_bad_spec(tmp_path, capsys):
    rc = cli_main(
        [
            "sweep",
            "--grid",
            "kl.coef=0,0.05",
            "trainer.total_steps=2",
            "--out",
            str(tmp_path / "s"),
            "--dry-run",
            "--workers",
            "1",
        ]
    )
    out = capsys.readouterr().out.splitlines()
    assert (
        rc == 0
        and len(out) == 2
        and out[0].startswith("[to run] ")
        and "kl.coef=0.05" in out[1]
        and "trainer.total_steps=2" in out[1]
    )
    assert cli_main(["sweep", "--grid", "kl.coeff=0,1", "--dry-run"]) == 2
    assert "unknown config key 'kl.coeff'" in capsys.readouterr().err
    assert cli_main(["sweep", "--grid", "kl.coef", "--dry-run"]) == 2


def test_cli_overrides_may_stand_anywhere_among_the_flags(tmp_path, capsys):
    """`--grid ... KEY=V --out D --workers 2 KEY2=V2` said "unrecognized arguments: KEY2=V2": every run gets both,
    in the order written (the later one wins for a repeated key); an unknown flag among them is still an error."""
    rc = cli_main(
        [
            "sweep",
            "--grid",
            "kl.coef=0,0.05",
            "trainer.total_steps=2",
            "--out",
            str(tmp_path / "s"),
            "--workers",
            "2",
            "trainer.seed=3",
            "--dry-run",
            "trainer.total_steps=5",
        ]
    )
    out = capsys.readouterr().out.splitlines()
    assert rc == 0 and len(out) == 2
    for line in out:  # the sweep keeps one value per key: the later one
        assert "trainer.seed=3" in line and "trainer.total_steps=5" in line and "trainer.total_steps=2" not in line
    with pytest.raises(SystemExit) as e:
        cli_main(["sweep", "--grid", "kl.coef=0,1", "trainer.seed=3", "--wokers", "2", "--dry-run"])
    assert e.value.code == 2 and "unrecognized arguments: --wokers 2" in capsys.readouterr().err


def test_cli_a_misspelt_command_gets_a_did_you_mean(capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["trian", "kl.coef=0.1"])
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "tether: error: unknown command 'trian'; did you mean train? commands: train, sft, report, doctor, view, "
        "export, sweep, eval, plan, data (tether --help)"
    )
    with pytest.raises(SystemExit):
        cli_main(["frobnicate"])
    assert "unknown command 'frobnicate'; commands: train, sft," in capsys.readouterr().err


@pytest.mark.slow
def test_tiny_real_sweep(tmp_path, capsys):
    """2 configs × 2 steps of real training, exact evaluation on the val prompts, then a resumed no-op."""
    out = tmp_path / "sweep"
    args = [
        "sweep",
        "--grid",
        "kl.coef=0,0.05",
        "trainer.total_steps=2",
        "trainer.val_freq=2",
        "data.batch_size=4",
        "rollout.n=4",
        "trainer.loggers=[jsonl]",
        "--out",
        str(out),
        "--workers",
        "2",
        "--exact-final",
        "val",
    ]
    assert cli_main(args) == 0
    with (out / "table.csv").open() as f:
        rows = {r["name"]: r for r in csv.DictReader(f)}
    assert set(rows) == {"kl.coef=0", "kl.coef=0.05"}
    assert {r["beta"] for r in rows.values()} == {"0.0", "0.05"}
    optimum = {c["beta"]: c for c in sw.optimum_curve(sw.exact_prompts("val"), [1e-6, 0.05])}
    for name, r in rows.items():
        assert r["status"] == "finished" and r["steps"] == "2" and r["exact_source"] == "val"
        assert 0.3 < float(r["exact_score"]) < 0.7  # two small steps from π_ref (0.46 on these prompts)
        assert 0 <= float(r["exact_kl_tok"]) < 0.1
        # KL(π*_β‖π_ref) at the run's final β (floored at 1e-6): the optimum's curve at that β, ≈ −log P_ref(correct)
        # for small β
        assert float(r["opt_kl_seq"]) == pytest.approx(optimum[max(float(r["beta"]), 1e-6)]["kl_seq"], rel=1e-9)
        assert float(r["opt_kl_seq"]) == pytest.approx(0.78, abs=0.1)
        assert (out / name / sw.EXACT_FINAL).is_file() and (out / name / sw.DONE_MARKER).is_file()
    assert (out / "reward_vs_kl.png").is_file() and (out / "reward_vs_diversity.png").is_file()
    curve = json.loads((out / "optimum_curve.json").read_text())
    assert curve["prompts"] == "val" and curve["curve"][0]["beta"] == 0.0
    capsys.readouterr()
    t0 = time.perf_counter()
    assert cli_main(args) == 0
    assert time.perf_counter() - t0 < 20
    assert capsys.readouterr().out.count("skipped") == 2
