"""The flexible GSM8K reward agrees with the human labels of example_model_solutions.jsonl."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tether.testing import find_gsm8k_dir

ROOT = Path(__file__).resolve().parents[2]


def _benchmark():
    spec = importlib.util.spec_from_file_location("gsm8k_reward_agreement", ROOT / "benchmarks" / "gsm8k_reward_agreement.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_flexible_agreement_at_least_99_percent():
    d = find_gsm8k_dir(Path(__file__))
    if d is None:
        pytest.skip("GSM8K data not found at ../shared/data/gsm8k (relative to the project root)")
    res = _benchmark().agreement(d / "example_model_solutions.jsonl")
    assert res["n"] == 5276
    flex = res["modes"]["flexible"]
    assert flex["overall"]["agreement"] >= 0.99, flex
    for key, s in flex["per_model"].items():
        assert s["n"] == 1319 and s["agreement"] >= 0.99, (key, s)
    assert res["modes"]["strict"]["overall"]["agreement"] >= 0.99
