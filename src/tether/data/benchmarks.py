"""AIME, GPQA and MATH-500 → verl schema: the backend of ``tether data aime|gpqa|math500 SRC OUT``.

Nothing is downloaded: point the converter at a local copy of a set in its public layout.

=========  =====================================================  ======================================
set        source layout (field names matched case-insensitively)  row written
=========  =====================================================  ======================================
AIME       ``problem`` (or ``question``), ``answer`` (an integer   ``data_source: "aime"``, ground truth
           0-999 or its digits, ``"033"``); jsonl / json /        the integer as a string (``"33"``)
           parquet, e.g. AI-MO/aimo-validation-aime,
           HuggingFaceH4/aime_2024, Maxwell-Jia/AIME_2024
MATH-500   ``problem``, ``answer`` (else the last ``\\boxed{}``     ``data_source: "HuggingFaceH4/MATH-500"``,
           of ``solution``); ``subject``, ``level``,               ground truth the answer's LaTeX
           ``unique_id`` kept in ``extra_info``
GPQA       ``Question``, ``Correct Answer``, ``Incorrect Answer``  ``data_source: "Idavidrein/gpqa"``, the
           ``1``-``3``; csv (as published) / jsonl / parquet       four options shuffled per question,
           (Diamond, main, extended)                               ground truth the correct letter
=========  =====================================================  ======================================

Prompt templates (:data:`TEMPLATES`; ``template=`` / ``--template`` overrides them). Placeholders
are replaced literally, so LaTeX braces need no escaping: ``{problem}`` (AIME, MATH-500),
``{question}`` and ``{A}`` … ``{D}`` (GPQA).

* AIME and MATH-500: the problem followed by verl's MATH instruction (``examples/data_preprocess/
  math_dataset.py``), "Let's think step by step and output the final answer within \\boxed{}."
* GPQA: the multiple-choice template of OpenAI's simple-evals (also lighteval's ``gpqa:diamond``
  instruct task): the instruction to end with ``Answer: LETTER``, the question, and the options as
  ``A) ...`` lines.

GPQA's shuffle: the options of a question are permuted by ``random.Random(f"{seed}:{question}")``
(a string seed is hashed with SHA-512, so the order depends only on the seed and the question text,
not on the file's order, the interpreter or ``PYTHONHASHSEED``). ``extra_info`` records the letters'
texts (``choices``), the correct text and the permutation.
"""

from __future__ import annotations

import csv
import io
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tether.rewards.benchmarks import parse_aime_ground_truth
from tether.rewards.math import extract_last_boxed

from .rows import MAX_REPORTED_ERRORS, DataError, not_an_object, read_records, write_records

__all__ = [
    "AIME_DATA_SOURCE",
    "CONVERTERS",
    "GPQA_DATA_SOURCE",
    "MATH500_DATA_SOURCE",
    "TEMPLATES",
    "convert_aime",
    "convert_gpqa",
    "convert_math500",
    "fill_template",
    "gpqa_options",
]

AIME_DATA_SOURCE = "aime"
MATH500_DATA_SOURCE = "HuggingFaceH4/MATH-500"
GPQA_DATA_SOURCE = "Idavidrein/gpqa"

_MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
_GPQA_TEMPLATE = (
    "Answer the following multiple choice question. The last line of your response should be of the following format: "
    "'Answer: $LETTER' (without quotes) where LETTER is one of ABCD. Think step by step before "
    "answering.\n\n{question}\n\nA) {A}\nB) {B}\nC) {C}\nD) {D}"
)
#: The default prompt template of each set (module docstring).
TEMPLATES = {
    "aime": "{problem} " + _MATH_INSTRUCTION,
    "math500": "{problem} " + _MATH_INSTRUCTION,
    "gpqa": _GPQA_TEMPLATE,
}
_PLACEHOLDERS = {"aime": ("problem",), "math500": ("problem",), "gpqa": ("question", "A", "B", "C", "D")}


def fill_template(template: str, **fields: str) -> str:
    """Replace each ``{name}`` of ``fields`` in ``template`` literally (other braces are kept)."""
    for name, value in fields.items():
        template = template.replace("{" + name + "}", value)
    return template


def _check_template(template: str, kind: str) -> None:
    missing = [p for p in _PLACEHOLDERS[kind] if "{" + p + "}" not in template]
    if missing:
        raise DataError(
            f"the {kind} template needs the placeholder(s) {', '.join('{' + p + '}' for p in missing)}; got "
            f"{template!r}"
        )


def _read_source(src: Path) -> list[tuple[str, Any]]:
    """Records of a .csv (header row; locators name the 1-based line; a UTF-8 byte-order mark is
    skipped) or any :func:`read_records` file.

    Raises:
        DataError: a missing file; a file that is not UTF-8 text (one line naming the file and, as
            ``position``, the byte offset in the file of the first byte that is not UTF-8, worded
            as the training loader words it); a csv the csv module cannot read (line named); the
            other problems of :func:`~tether.data.rows.read_records`.
    """
    if src.suffix.lower() != ".csv":
        return read_records(src)
    if not src.is_file():
        raise DataError(f"{src}: no such file")
    try:
        # the whole file at once: the error's position is the file's byte offset
        text = src.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{src}: not a UTF-8 text file, so not .csv: {e}; re-save it as UTF-8") from e
    if text.startswith("\ufeff"):
        text = text[1:]
    reader = csv.DictReader(io.StringIO(text, newline=""))
    try:
        return [(f"line {i}", rec) for i, rec in enumerate(reader, start=2)]
    except csv.Error as e:  # a NUL byte, a field over csv's size limit, ...
        raise DataError(f"{src}: not a readable csv file: line {reader.line_num}: {e}") from e


def _field(rec: dict, *names: str) -> Any:
    lower = {str(k).strip().lower(): v for k, v in rec.items()}
    for n in names:
        if n.lower() in lower and lower[n.lower()] is not None:
            return lower[n.lower()]
    return None


def _convert(src: str | Path, out: str | Path, make_row: Callable[[int, dict], dict | str]) -> int:
    src = Path(src)
    records, bad = [], []
    located = _read_source(src)
    for loc, rec in located:
        row = not_an_object(rec) or make_row(len(records), rec)
        if isinstance(row, str):
            bad.append(f"{src}: {loc}: {row}")
        else:
            records.append(row)
    if bad:
        raise DataError(
            f"{src}: {len(bad)} malformed row(s):\n  " + "\n  ".join(bad[:MAX_REPORTED_ERRORS]),
            bad[:MAX_REPORTED_ERRORS],
            len(bad),
        )
    if not records:
        raise DataError(f"{src}: empty dataset (no rows)")
    return write_records(records, out)


def _text(v: Any) -> str | None:
    return v.strip() if isinstance(v, str) and v.strip() else None


def convert_aime(
    src: str | Path,
    out: str | Path,
    *,
    template: str = TEMPLATES["aime"],
    data_source: str = AIME_DATA_SOURCE,
    split: str = "test",
) -> int:
    """Convert an AIME file (``problem``/``question``, ``answer``) to verl-schema rows.

    Returns:
        The number of rows written.

    Raises:
        DataError: a missing source or one that is not UTF-8 text (file and byte offset named), a
            row without a problem or with an answer that is not an integer in 0..999 (file and line
            named), a template without ``{problem}``, an unsupported output extension.
    """
    _check_template(template, "aime")

    def row(i: int, rec: dict) -> dict | str:
        problem, answer = _text(_field(rec, "problem", "question")), _field(rec, "answer")
        if problem is None:
            return "no 'problem' (or 'question') text"
        if answer is None:
            return "no 'answer' column (an AIME file needs 'problem' and 'answer')"
        try:
            gt = parse_aime_ground_truth(answer.strip() if isinstance(answer, str) else answer)
        except ValueError as e:
            return str(e)
        extra = {"split": split, "index": i, "problem": problem}
        extra |= {k: _field(rec, k) for k in ("id", "year", "url") if _field(rec, k) is not None}
        return {
            "data_source": data_source,
            "prompt": [{"role": "user", "content": fill_template(template, problem=problem)}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(gt)},
            "extra_info": extra,
        }

    return _convert(src, out, row)


def convert_math500(
    src: str | Path,
    out: str | Path,
    *,
    template: str = TEMPLATES["math500"],
    data_source: str = MATH500_DATA_SOURCE,
    split: str = "test",
) -> int:
    """Convert a MATH / MATH-500 file (``problem``, ``answer`` or a ``solution`` with ``\\boxed{}``).

    Returns:
        The number of rows written.

    Raises:
        DataError: a missing source or one that is not UTF-8 text (file and byte offset named), a
            row without a problem or an answer, a template without ``{problem}``, an unsupported
            output extension.
    """
    _check_template(template, "math500")

    def row(i: int, rec: dict) -> dict | str:
        problem = _text(_field(rec, "problem", "question"))
        if problem is None:
            return "no 'problem' text"
        answer = _field(rec, "answer")
        answer = str(answer).strip() if answer is not None and str(answer).strip() else None
        if answer is None and _text(_field(rec, "solution")):
            answer = extract_last_boxed(_field(rec, "solution"))
        if not answer:
            return "no 'answer' (and no \\boxed{} answer in 'solution')"
        extra = {"split": split, "index": i, "problem": problem}
        extra |= {k: _field(rec, k) for k in ("subject", "level", "unique_id") if _field(rec, k) is not None}
        return {
            "data_source": data_source,
            "prompt": [{"role": "user", "content": fill_template(template, problem=problem)}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": extra,
        }

    return _convert(src, out, row)


def gpqa_options(
    question: str, correct: str, incorrect: list[str], seed: int = 0
) -> tuple[dict[str, str], str, list[int]]:
    """The four options of a GPQA question in their shuffled order.

    Returns:
        ``(choices, letter, permutation)``: ``{"A": text, ...}``, the correct option's letter, and
        for each letter the index of its text in ``[correct, *incorrect]`` (0 = the correct one).
    """
    texts = [correct, *incorrect]
    perm = list(range(4))
    random.Random(f"{seed}:{question}").shuffle(perm)
    choices = {letter: texts[j] for letter, j in zip("ABCD", perm, strict=True)}
    return choices, "ABCD"[perm.index(0)], perm


def convert_gpqa(
    src: str | Path,
    out: str | Path,
    *,
    template: str = TEMPLATES["gpqa"],
    data_source: str = GPQA_DATA_SOURCE,
    seed: int = 0,
    split: str = "test",
) -> int:
    """Convert a GPQA file (``Question``, ``Correct Answer``, ``Incorrect Answer 1..3``; csv, jsonl,
    json or parquet) to verl-schema rows with the options shuffled per question (:func:`gpqa_options`).

    Returns:
        The number of rows written.

    Raises:
        DataError: a missing source or one that is not UTF-8 text (file and byte offset named), a
            row without a question or one of the four answers (line named), a template without
            ``{question}`` and ``{A}`` … ``{D}``, an unsupported output extension.
    """
    _check_template(template, "gpqa")

    def row(i: int, rec: dict) -> dict | str:
        q = _text(_field(rec, "Question"))
        correct = _text(_field(rec, "Correct Answer"))
        wrong = [_text(_field(rec, f"Incorrect Answer {j}")) for j in (1, 2, 3)]
        missing = [
            name
            for name, v in (
                ("Question", q),
                ("Correct Answer", correct),
                *((f"Incorrect Answer {j}", w) for j, w in zip((1, 2, 3), wrong, strict=True)),
            )
            if v is None
        ]
        if missing:
            return f"missing or empty field(s) {missing}"
        choices, letter, perm = gpqa_options(q, correct, wrong, seed)
        extra = {
            "split": split,
            "index": i,
            "question": q,
            "choices": choices,
            "correct_answer": correct,
            "permutation": perm,
            "shuffle_seed": seed,
        }
        extra |= {
            k.lower().replace(" ", "_"): _field(rec, k)
            for k in ("Record ID", "Subdomain", "High-level domain")
            if _field(rec, k)
        }
        content = fill_template(template, question=q, **choices)
        return {
            "data_source": data_source,
            "prompt": [{"role": "user", "content": content}],
            "ability": "science",
            "reward_model": {"style": "rule", "ground_truth": letter},
            "extra_info": extra,
        }

    return _convert(src, out, row)


#: ``tether data NAME`` → its converter.
CONVERTERS = {"aime": convert_aime, "gpqa": convert_gpqa, "math500": convert_math500}
