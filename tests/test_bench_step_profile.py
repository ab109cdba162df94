"""benchmarks/bench_step_profile.py: the kernel classes and the floor it prints (issue 13)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_step_profile", ROOT / "benchmarks" / "bench_step_profile.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_kernel_classes():
    assert bench.classify("aten::mm") == bench.classify("aten::addmm") == "linear matmuls"
    assert bench.classify("aten::_scaled_dot_product_flash_attention_for_cpu") == "attention"
    assert bench.classify("aten::_scaled_dot_product_flash_attention_for_cpu_backward") == "attention"
    assert bench.classify("aten::bmm") == "attention"  # tether's matmul attention path
    assert bench.classify("aten::exponential_") == "sampling"
    assert bench.classify("aten::mul") == bench.classify("aten::copy_") == "everything else"


def test_table_row_shares_rate_and_floor():
    # a 2 s step: 1.0 s of matmuls doing 90 GFLOP -> 90 GFLOP/s; at a 100 GFLOP/s peak the floor is 0.9 s
    secs = {"linear matmuls": 1.0, "attention": 0.5, "sampling": 0.1, "everything else": 0.4}
    header, rule, row = bench.table([("tether", 2.0, secs, 90e9, 100e9)])
    assert header.count("|") == rule.count("|") == row.count("|")
    assert row == "| tether | 2.000 | 1.000 (50%) | 0.500 (25%) | 0.100 (5%) | 0.400 (20%) | 90.0 | 90.0 | 0.900 |"
