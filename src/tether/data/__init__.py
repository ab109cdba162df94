"""Datasets for tether: verl-schema rows from jsonl / json / parquet, prompt rendering with chat
templates, GSM8K conversion, deterministic splits. See ``docs/data.md``."""

from .gsm8k import (
    DEFAULT_INSTRUCTION_SUFFIX,
    GSM8K_DATA_SOURCE,
    convert_gsm8k,
    convert_gsm8k_solutions,
    gsm8k_final_answer,
)
from .prompts import (
    check_chat_template,
    check_prompt_lengths,
    has_chat_template,
    is_multi_turn,
    render_prompt,
    render_prompts,
)
from .rows import (
    MAX_REPORTED_ERRORS,
    VALID_ROLES,
    DataError,
    LoadReport,
    PromptRow,
    load_rows,
    load_rows_report,
    read_records,
    rows_from_records,
    split_rows,
    write_records,
)

__all__ = [
    "DEFAULT_INSTRUCTION_SUFFIX",
    "GSM8K_DATA_SOURCE",
    "MAX_REPORTED_ERRORS",
    "VALID_ROLES",
    "DataError",
    "LoadReport",
    "PromptRow",
    "check_chat_template",
    "check_prompt_lengths",
    "convert_gsm8k",
    "convert_gsm8k_solutions",
    "gsm8k_final_answer",
    "has_chat_template",
    "is_multi_turn",
    "load_rows",
    "load_rows_report",
    "read_records",
    "render_prompt",
    "render_prompts",
    "rows_from_records",
    "split_rows",
    "write_records",
]
