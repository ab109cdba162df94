from __future__ import annotations

from pathlib import Path

import pytest

from tether.testing import build_gsm8k_tokenizer, find_gsm8k_dir


@pytest.fixture(scope="session")
def gsm8k_dir() -> Path:
    """The shared GSM8K data (../shared/data/gsm8k from the project root); skip when absent."""
    d = find_gsm8k_dir(Path(__file__))
    if d is None:
        pytest.skip(
            "GSM8K data not found at ../shared/data/gsm8k (relative to the project root) and TETHER_GSM8K_DIR is not "
            "set"
        )
    return d


@pytest.fixture(scope="session")
def chat_tokenizer_dir(tmp_path_factory) -> Path:
    """A tiny byte-level BPE tokenizer with a Qwen2-style chat template (no downloads)."""
    return build_gsm8k_tokenizer(tmp_path_factory.mktemp("tok_chat"))


@pytest.fixture(scope="session")
def plain_tokenizer_dir(tmp_path_factory) -> Path:
    """The same tokenizer without a chat template (like a base model's)."""
    return build_gsm8k_tokenizer(tmp_path_factory.mktemp("tok_plain"), chat_template=False)
