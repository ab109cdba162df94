"""GSM8K → verl schema: the backend of ``tether data gsm8k SRC OUT``.

GSM8K (Cobbe et al. 2021, arXiv:2110.14168) ships as jsonl with ``question`` and ``answer`` (a worked
solution whose last line is ``#### <number>``). :func:`convert_gsm8k` writes the same rows verl's
``examples/data_preprocess/gsm8k.py`` writes::

    {"data_source": "openai/gsm8k",
     "prompt": [{"role": "user", "content": question + DEFAULT_INSTRUCTION_SUFFIX}],
     "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": "72"},
     "extra_info": {"split": "train", "index": 0, "answer": <worked solution>, "question": question}}

``ground_truth`` is the number after the last ``####`` with thousands commas removed (as verl does).

:func:`convert_gsm8k_solutions` flattens ``example_model_solutions.jsonl`` (four labelled model
solutions per question) into an offline prompt/response dataset with a ``score`` column (1.0 when
the solution is labelled correct, else 0.0), to load with
``load_rows(path, response_key="response", score_key="score")``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from .rows import DataError, not_an_object, read_records, write_records

__all__ = [
    "DEFAULT_INSTRUCTION_SUFFIX",
    "GSM8K_DATA_SOURCE",
    "SOLUTION_MODEL_KEYS",
    "convert_gsm8k",
    "convert_gsm8k_solutions",
    "gsm8k_final_answer",
]

#: verl's instruction, appended (after one space) to each question.
DEFAULT_INSTRUCTION_SUFFIX = ' Let\'s think step by step and output the final answer after "####".'
#: The ``data_source`` written for GSM8K rows (selects the GSM8K reward).
GSM8K_DATA_SOURCE = "openai/gsm8k"
#: The model keys of ``example_model_solutions.jsonl``.
SOLUTION_MODEL_KEYS = ("6b_finetuning", "6b_verification", "175b_finetuning", "175b_verification")

_HASHES = re.compile(r"####\s*(-?[0-9.,]*[0-9])")
_A_COLON = re.compile(r"\bA:\s*(-?[0-9.,]*[0-9])")


def gsm8k_final_answer(answer_text: str, *, allow_a_colon: bool = True) -> str | None:
    """The final answer of a GSM8K worked solution as a string.

    The number after the last ``####``; when there is none and ``allow_a_colon``, the number after
    the last ``A:`` (the format of ``example_model_solutions.jsonl``). Thousands commas are removed
    (``"1,000"`` → ``"1000"``), as verl does. None when there is no such number.
    """
    found = _HASHES.findall(answer_text)
    if not found and allow_a_colon:
        found = _A_COLON.findall(answer_text)
    if not found:
        return None
    return found[-1].replace(",", "") or None


def _load_src(src: Path, required: tuple[str, ...]) -> list[tuple[str, dict]]:
    located = read_records(src)
    problems = []
    out = []
    for loc, rec in located:
        problem = not_an_object(rec)
        if problem:
            problems.append(f"{src}: {loc}: {problem}")
            continue
        missing = [k for k in required if not isinstance(rec.get(k), str)]
        if missing:
            problems.append(f"{src}: {loc}: missing or non-text field(s) {missing}")
            continue
        out.append((loc, rec))
    if problems:
        converted = any(isinstance(rec, dict) and "prompt" in rec and "reward_model" in rec for _, rec in located)
        hint = (
            (
                f"\n{src} looks already converted to verl's schema (it has 'prompt' and 'reward_model'): train on it "
                f"directly with data.train_files={src}"
            )
            if converted
            else ""
        )
        raise DataError(
            f"{src}: {len(problems)} malformed row(s):\n  " + "\n  ".join(problems[:20]) + hint,
            problems[:20],
            len(problems),
        )
    if not out:
        raise DataError(f"{src}: empty dataset (no rows)")
    return out


def convert_gsm8k(
    src: str | Path,
    out: str | Path,
    *,
    instruction_suffix: str = DEFAULT_INSTRUCTION_SUFFIX,
    split: str | None = None,
) -> int:
    """Convert a GSM8K jsonl file (``question``, ``answer``) to verl-schema rows.

    Args:
        src: the GSM8K file (``train.jsonl`` / ``test.jsonl``; any format :func:`read_records`
            reads).
        out: the output; ``.jsonl``, ``.json`` or ``.parquet`` by its extension.
        instruction_suffix: appended to each question in the user message (default: verl's
            :data:`DEFAULT_INSTRUCTION_SUFFIX`; ``""`` for none).
        split: ``extra_info.split``; default the stem of ``src`` (``"train"`` for ``train.jsonl``).

    Returns:
        The number of rows written.

    Raises:
        DataError: ``src`` missing / malformed (file and line named), a row without a ``####``
            answer, or an unsupported output extension.
    """
    src = Path(src)
    split = split if split is not None else src.stem
    records = []
    bad = []
    for i, (loc, rec) in enumerate(_load_src(src, ("question", "answer"))):
        gt = gsm8k_final_answer(rec["answer"], allow_a_colon=False)
        if gt is None:
            bad.append(f"{src}: {loc}: 'answer' has no '#### <number>' final line")
            continue
        q = rec["question"]
        records.append(
            {
                "data_source": GSM8K_DATA_SOURCE,
                "prompt": [{"role": "user", "content": q + instruction_suffix}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": gt},
                "extra_info": {"split": split, "index": i, "answer": rec["answer"], "question": q},
            }
        )
    if bad:
        raise DataError(
            f"{src}: {len(bad)} row(s) without a final answer:\n  " + "\n  ".join(bad[:20]), bad[:20], len(bad)
        )
    return write_records(records, out)


def convert_gsm8k_solutions(
    src: str | Path,
    out: str | Path,
    *,
    models: tuple[str, ...] = SOLUTION_MODEL_KEYS,
    instruction_suffix: str = "",
) -> int:
    """Flatten ``example_model_solutions.jsonl`` into an offline RLHF dataset.

    One output row per (question, model): verl-schema fields as in :func:`convert_gsm8k` (ground
    truth = the number after ``A:`` in the file's ``ground_truth``), plus ``response`` (the model's
    solution, which ends with ``A: <number>``) and ``score`` (1.0 if labelled ``is_correct`` else
    0.0); ``extra_info`` gains ``model`` and ``is_correct``. Rows are ordered question-major.

    Args:
        src: ``example_model_solutions.jsonl``.
        out: output file (``.jsonl`` / ``.json`` / ``.parquet``).
        models: which model keys to take (default all four).
        instruction_suffix: appended to each question (default none: the solutions were written
            without verl's instruction).

    Returns:
        The number of rows written (``5276`` for the full file and all four models).

    Raises:
        DataError: malformed source (line named), a row missing a model key, or a ground truth
            without ``A: <number>``.
    """
    src = Path(src)
    records = []
    bad = []
    for i, (loc, rec) in enumerate(_load_src(src, ("question", "ground_truth"))):
        gt = gsm8k_final_answer(rec["ground_truth"])
        if gt is None:
            bad.append(f"{src}: {loc}: 'ground_truth' has no 'A: <number>'")
            continue
        for m in models:
            sol = rec.get(m)
            if not isinstance(sol, dict) or not isinstance(sol.get("solution"), str):
                bad.append(f"{src}: {loc}: no solution under {m!r}")
                continue
            ok = bool(sol.get("is_correct"))
            records.append(
                {
                    "data_source": GSM8K_DATA_SOURCE,
                    "prompt": [{"role": "user", "content": rec["question"] + instruction_suffix}],
                    "ability": "math",
                    "reward_model": {"style": "rule", "ground_truth": gt},
                    "extra_info": {
                        "split": "test",
                        "index": i,
                        "question": rec["question"],
                        "model": m,
                        "is_correct": ok,
                    },
                    "response": sol["solution"],
                    "score": 1.0 if ok else 0.0,
                }
            )
    if bad:
        raise DataError(f"{src}: {len(bad)} problem(s):\n  " + "\n  ".join(bad[:20]), bad[:20], len(bad))
    return write_records(records, out)


def _main(argv: list[str] | None = None) -> int:  # pragma: no cover - thin wrapper for manual use
    import argparse

    ap = argparse.ArgumentParser(description="Convert GSM8K jsonl to verl-schema jsonl/parquet.")
    ap.add_argument("src")
    ap.add_argument("out")
    ap.add_argument("--instruction-suffix", default=DEFAULT_INSTRUCTION_SUFFIX)
    a = ap.parse_args(argv)
    n = convert_gsm8k(a.src, a.out, instruction_suffix=a.instruction_suffix)
    print(json.dumps({"rows": n, "out": a.out}))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(_main())
