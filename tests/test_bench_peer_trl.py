"""benchmarks/bench_peer_trl.py --curve: the per-step statistics that decide "the same learning curve" (issue 13)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

from tether.config import load_config

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_peer_trl", ROOT / "benchmarks" / "bench_peer_trl.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_mean_and_sample_std_per_step():
    # step 1: seeds 1, 3 -> mean 2, s = sqrt(((1-2)² + (3-2)²) / 1) = sqrt(2); step 2: 2, 6 -> 4, sqrt(8)
    (m1, s1), (m2, s2) = bench.curve_mean_std([[1.0, 2.0], [3.0, 6.0]])
    assert (m1, m2) == (2.0, 4.0)
    assert s1 == pytest.approx(math.sqrt(2), rel=1e-12) and s2 == pytest.approx(math.sqrt(8), rel=1e-12)
    assert bench.curve_mean_std([[0.5, 0.7]]) == [(0.5, 0.0), (0.7, 0.0)]  # one seed: no spread


def test_within_noise_is_two_standard_errors_of_the_difference():
    # three seeds each; step 1: a 0.50/0.52/0.54 (mean 0.52, s 0.02), b 0.48/0.50/0.52 (0.50, 0.02):
    # SE = sqrt(0.02²/3 + 0.02²/3) = 0.016330, bound 0.032660 > |Δ| 0.02 -> inside;
    # step 2: b 0.44/0.46/0.48 (mean 0.46): |Δ| 0.06 > 0.032660 -> outside
    a = [[0.50, 0.50], [0.52, 0.52], [0.54, 0.54]]
    b = [[0.48, 0.44], [0.50, 0.46], [0.52, 0.48]]
    (d1, b1, ok1), (d2, b2, ok2) = bench.within_noise(a, b)
    assert d1 == pytest.approx(0.02, abs=1e-12) and d2 == pytest.approx(0.06, abs=1e-12)
    assert b1 == pytest.approx(2 * math.sqrt(2 * 0.02**2 / 3), rel=1e-9) == b2
    assert b1 == pytest.approx(0.032660, abs=1e-6)
    assert (ok1, ok2) == (True, False)
    # the bound is Welch's: unequal seed counts weigh each side's variance by its own n
    ((_, wb, _),) = bench.within_noise(
        [[0.0], [2.0]], [[1.0], [1.0], [1.0], [4.0]]
    )  # s_a² = 2 (n 2), s_b² = 2.25 (n 4)
    assert wb == pytest.approx(2 * math.sqrt(2 / 2 + 2.25 / 4), rel=1e-12)


def test_round_off_kl_passes_only_with_the_floor():
    one_seed_each = ([[1e-15]], [[0.0]])  # no spread: the bound is 0
    assert bench.within_noise(*one_seed_each) == [(1e-15, 0.0, False)]
    assert bench.within_noise(*one_seed_each, atol=bench.KL_ATOL) == [(1e-15, 1e-6, True)]
    assert bench.within_noise([[2e-6]], [[0.0]], atol=bench.KL_ATOL)[0][2] is False


def _run(rewards, kls):
    return {"steps": [{"reward": r, "kl": k} for r, k in zip(rewards, kls, strict=True)]}


def test_report_counts_the_steps_inside_and_names_the_others():
    runs = {
        "tether": [
            _run([0.50, 0.52], [0.0, 0.010]),
            _run([0.52, 0.52], [0.0, 0.012]),
            _run([0.54, 0.52], [0.0, 0.014]),
        ],
        "trl": [_run([0.48, 0.46], [0.0, 0.011]), _run([0.50, 0.46], [0.0, 0.012]), _run([0.52, 0.46], [0.0, 0.013])],
    }
    text = "\n".join(bench.report_curve("tiny", runs, 3e-3))
    assert "| 1 | 0.520 ± 0.020 | 0.500 ± 0.020 |" in text
    # reward step 2: both spreads 0, |Δ| 0.06 -> outside; KL: step 1 equal (0 = 0), step 2 |Δ| 0 -> inside
    assert "reward 1/2 steps (outside: [2]" in text
    assert "kl 2/2 steps (outside: none" in text
    assert "final-step reward: tether 0.520 ± 0.000, trl 0.460 ± 0.000" in text


def test_the_curve_options_reach_tethers_config(tmp_path):
    over = bench.tether_overrides(tmp_path / "m", tmp_path / "p.jsonl", 3, 32, tmp_path / "run", lr=3e-3, seed=4)
    cfg = load_config(None, over)
    assert (cfg.actor.lr, cfg.trainer.seed) == (3e-3, 4)
    assert (
        cfg.kl.placement,
        cfg.kl.estimator,
        cfg.kl.coef,
        cfg.algo.norm_by_std,
        cfg.algo.clip_eps_low,
        cfg.algo.clip_eps_high,
    ) == (
        "loss",
        "k3",
        0.04,
        "group",
        0.2,
        0.2,
    )
