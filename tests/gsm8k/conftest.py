"""Fixtures for the GSM8K end-to-end tests: a tiny Qwen2 model with a chat template, and a handful of
GSM8K rows converted to verl's schema (skipped cleanly when ../shared/data/gsm8k is absent)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from tether.data import convert_gsm8k, convert_gsm8k_solutions
from tether.testing import build_gsm8k_tokenizer, build_tiny_causal_lm, find_gsm8k_dir


@pytest.fixture(scope="session")
def gsm8k_dir() -> Path:
    d = find_gsm8k_dir(Path(__file__))
    if d is None:
        pytest.skip(
            "GSM8K data not found at ../shared/data/gsm8k (relative to the project root) and TETHER_GSM8K_DIR is not "
            "set"
        )
    return d


@pytest.fixture(scope="session")
def qwen2_dir(tmp_path_factory) -> Path:
    """A random tiny Qwen2ForCausalLM with the GSM8K BPE tokenizer and a Qwen2-style chat template."""
    root = tmp_path_factory.mktemp("qwen2")
    tok = build_gsm8k_tokenizer(root / "tok")
    return build_tiny_causal_lm(root / "model", tok, arch="qwen2", hidden=32, layers=2, heads=2, seed=0)


@pytest.fixture(scope="session")
def gsm8k_files(gsm8k_dir, tmp_path_factory) -> dict[str, Path]:
    """train/val: 8 / 4 GSM8K questions in verl's schema. offline: the four labelled model solutions of
    the first three questions whose labels are mixed (so GRPO advantages are not all zero)."""
    root = tmp_path_factory.mktemp("gsm8k_data")
    (root / "train_src.jsonl").write_text("".join(itertools.islice(open(gsm8k_dir / "train.jsonl"), 8)))
    (root / "test_src.jsonl").write_text("".join(itertools.islice(open(gsm8k_dir / "test.jsonl"), 4)))
    mixed = []
    with open(gsm8k_dir / "example_model_solutions.jsonl") as f:
        for line in f:
            rec = json.loads(line)
            labels = {
                rec[m]["is_correct"]
                for m in ("6b_finetuning", "6b_verification", "175b_finetuning", "175b_verification")
            }
            if len(labels) == 2:
                mixed.append(line)
            if len(mixed) == 3:
                break
    (root / "sol_src.jsonl").write_text("".join(mixed))
    convert_gsm8k(root / "train_src.jsonl", root / "train.jsonl")
    convert_gsm8k(root / "test_src.jsonl", root / "test.parquet")
    convert_gsm8k_solutions(root / "sol_src.jsonl", root / "offline.jsonl")
    return {"train": root / "train.jsonl", "val": root / "test.parquet", "offline": root / "offline.jsonl"}
