"""Prompt datasets: a typed row, loading from jsonl / json / parquet in verl's schema, validation.

Schema (verl's, so a verl user's files work unchanged)::

    {"data_source": "openai/gsm8k",
     "prompt": [{"role": "user", "content": "..."}],      # chat messages, or a plain string
     "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": "72"},
     "extra_info": {"split": "train", "index": 0, ...}}

Plain ``{"prompt": "some text"}`` rows work too. Field rules, as implemented by
:func:`rows_from_records`:

* ``prompt`` (or the column named by ``prompt_key``): required. A non-empty string (not only
  whitespace), or a non-empty list of messages; each message a dict with ``role`` in
  :data:`VALID_ROLES` and ``content`` a string (multimodal content parts are not supported). Extra
  message keys are kept. A list whose messages all have empty content is an empty prompt.
* ``data_source``: a non-empty string; absent or null → ``default_data_source``.
* ground truth: ``reward_model.ground_truth`` (verl); when there is no ``reward_model`` object, a
  top-level ``ground_truth`` field; otherwise None. Any JSON value is accepted as is.
* ``extra_info``: a dict or null/absent (→ ``{}``). ``ability`` and any other unknown top-level
  fields are kept in ``extra_info`` under their own names only if ``extra_info`` lacks them (so
  nothing the reward function might want is lost).
* offline data: with ``response_key`` set, that column is required and must be a string (it may
  be empty); with ``score_key`` set, that column is required and must be a finite number or null
  (null → no dataset score; the reward function or model scores the row).

Bad rows are **fatal by default**: loading raises one :class:`DataError` listing the first
:data:`MAX_REPORTED_ERRORS` problems, each with the file, the 1-based line (jsonl) or record
(json list, parquet) number and what is wrong. With ``skip_invalid=True`` they are dropped and
counted instead (see :func:`load_rows_report`; :func:`load_rows` then warns with the count). An
empty dataset (no rows at all, or none left after skipping) is always an error.
"""

from __future__ import annotations

import json
import logging
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tether.outputs import output_problem

__all__ = [
    "MAX_REPORTED_ERRORS",
    "VALID_ROLES",
    "DataError",
    "LoadReport",
    "PromptRow",
    "load_rows",
    "load_rows_report",
    "not_an_object",
    "read_records",
    "rows_from_records",
    "split_rows",
    "write_records",
]

log = logging.getLogger("tether")

#: Chat roles accepted in a prompt's messages.
VALID_ROLES = frozenset({"system", "user", "assistant", "tool"})
#: How many individual problems one :class:`DataError` lists.
MAX_REPORTED_ERRORS = 20

_SUFFIXES = (".jsonl", ".json", ".parquet")


class DataError(ValueError):
    """A dataset that cannot be used: missing file, wrong format, malformed or no rows.

    ``problems`` holds the individual messages (at most :data:`MAX_REPORTED_ERRORS`),
    ``n_bad`` the total count of bad rows (may exceed ``len(problems)``).
    """

    def __init__(self, message: str, problems: Sequence[str] = (), n_bad: int = 0):
        super().__init__(message)
        self.problems = list(problems)
        self.n_bad = n_bad


@dataclass(frozen=True)
class PromptRow:
    """One prompt of a dataset.

    Attributes:
        prompt: a plain string, or chat messages ``[{"role": ..., "content": ...}, ...]``.
        data_source: selects the built-in reward function (see ``tether.rewards``).
        ground_truth: what the reward function compares against (e.g. ``"72"``), or None.
        extra_info: free-form per-row information passed to the reward function.
        index: 0-based position of the record in its source (blank jsonl lines not counted; rows
            dropped with ``skip_invalid`` keep their numbers, so ``index`` always points back to
            the source record).
        response: a fixed response (offline RLHF data), or None.
        score: the dataset's reward for ``response``, or None.
        locator: where the record is in its file, as :func:`read_records` names it (``"line 9"``,
            1-based physical jsonl line; ``"record 3"``, 1-based, for .json/.parquet/in-memory
            records); ``""`` for rows built by hand. Not part of equality.

    Rows whose prompt is a list are not hashable (the dataclass is frozen but holds a list).
    """

    prompt: str | list[dict]
    data_source: str
    ground_truth: Any | None
    extra_info: dict
    index: int
    response: str | None = None
    score: float | None = None
    locator: str = field(default="", compare=False, repr=False)

    @property
    def where(self) -> str:
        """The row's place for messages: :attr:`locator`, else ``"record N"`` (1-based from ``index``),
        so every message about a file's rows counts them from 1 as its lines are."""
        return self.locator or f"record {self.index + 1}"


@dataclass
class LoadReport:
    """Result of :func:`load_rows_report`: the rows kept and what was dropped.

    Attributes:
        rows: the valid rows, in source order.
        n_skipped: rows dropped as invalid (0 unless ``skip_invalid=True``).
        problems: the first :data:`MAX_REPORTED_ERRORS` problem messages.
        source: the file (or source name) read.
    """

    rows: list[PromptRow]
    n_skipped: int = 0
    problems: list[str] = field(default_factory=list)
    source: str = ""


# ----------------------------------------------------------------------------------- reading


def _where(source: str, locator: str) -> str:
    return f"{source}: {locator}"


def read_records(path: str | Path) -> list[tuple[str, Any]]:
    """Read raw records from a ``.jsonl``, ``.json`` (a list of objects) or ``.parquet`` file.

    Args:
        path: the file. The format is chosen by the extension (case-insensitive).

    Returns:
        ``[(locator, record), ...]`` where ``locator`` is ``"line N"`` (jsonl; 1-based physical
        line) or ``"record N"`` (json, parquet; 1-based). Records are whatever the file holds
        (normally dicts); blank jsonl lines are skipped. Lines that are not valid JSON are
        returned as :class:`_BadLine` placeholders so that they are reported with the other
        problems.

    Raises:
        DataError: missing file, a directory, an unsupported extension, a file that is not what
            its extension says (not UTF-8 text, not JSON, not parquet, a ``.json`` that is not a
            list).
    """
    p = Path(path)
    src = str(p)
    if not p.exists():
        raise DataError(f"{src}: no such file")
    if p.is_dir():
        raise DataError(f"{src}: is a directory, expected a .jsonl, .json or .parquet file")
    suffix = p.suffix.lower()
    if suffix not in _SUFFIXES:
        raise DataError(f"{src}: unsupported extension {p.suffix!r}; expected one of {', '.join(_SUFFIXES)}")
    if suffix == ".parquet":
        return _read_parquet(p)
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        head = p.read_bytes()[:4]
        hint = " (it looks like a parquet file; rename it to .parquet)" if head == b"PAR1" else ""
        raise DataError(f"{src}: not a UTF-8 text file, so not {suffix}{hint}: {e}") from e
    if text.startswith("\ufeff"):
        text = text[1:]
    if suffix == ".json":
        return _read_json(text, src)
    return _read_jsonl(text, src)


class _BadLine:
    """Placeholder for a jsonl line that is not valid JSON (reported as a row problem)."""

    def __init__(self, message: str):
        self.message = message


def not_an_object(rec: Any) -> str | None:
    """Why a record from :func:`read_records` is not a JSON object, or None when it is one.

    A jsonl line that is not valid JSON gives ``"invalid JSON (<reason> at column N)"``; any other
    non-dict, ``"expected a JSON object, got <type>"``. Every reader of raw records uses this, so a
    bad line is described alike by the training loader and the ``tether data`` converters.
    """
    if isinstance(rec, _BadLine):
        return rec.message
    if not isinstance(rec, dict):
        return f"expected a JSON object, got {type(rec).__name__}"
    return None


def _read_jsonl(text: str, src: str) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    # split on "\n" only: str.splitlines() would also split inside JSON strings holding U+2028 etc.
    for i, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            out.append((f"line {i}", json.loads(line)))
        except json.JSONDecodeError as e:
            out.append((f"line {i}", _BadLine(f"invalid JSON ({e.msg} at column {e.colno})")))
    if out and all(isinstance(r, _BadLine) for _, r in out):
        if text.lstrip().startswith("["):
            raise DataError(f"{src}: not JSON Lines (it looks like a JSON list; rename it to .json)")
        loc, bad = out[0]
        raise DataError(f"{src}: not JSON Lines: no line is valid JSON ({loc}: {bad.message})")
    return out


def _read_json(text: str, src: str) -> list[tuple[str, Any]]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        hint = ""
        if e.msg == "Extra data":
            hint = " (several JSON values: it looks like JSON Lines; rename it to .jsonl)"
        raise DataError(f"{src}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}{hint}") from e
    if not isinstance(data, list):
        raise DataError(f"{src}: a .json dataset must be a JSON list of records, got {type(data).__name__}")
    return [(f"record {i}", r) for i, r in enumerate(data, start=1)]


def _read_parquet(p: Path) -> list[tuple[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:  # pragma: no cover - pyarrow is a dependency
        raise DataError(f"{p}: reading parquet needs pyarrow (pip install pyarrow)") from e
    try:
        table = pq.read_table(p)
    except Exception as e:  # pyarrow raises ArrowInvalid, OSError, ... for non-parquet files
        raise DataError(f"{p}: not a readable parquet file: {type(e).__name__}: {e}") from e
    return [(f"record {i}", r) for i, r in enumerate(table.to_pylist(), start=1)]


def write_records(records: Sequence[dict], path: str | Path) -> int:
    """Write records to ``.jsonl`` (one JSON object per line, UTF-8), ``.json`` (a list) or
    ``.parquet`` (via ``pyarrow.Table.from_pylist``), chosen by the extension; parent directories
    are created.

    Args:
        records: JSON-serialisable dicts.
        path: the output file.

    Returns:
        The number of records written.

    Raises:
        DataError: unsupported extension; a path that is a directory or lies under a file.
    """
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix not in _SUFFIXES:
        raise DataError(f"{p}: unsupported extension {p.suffix!r}; expected one of {', '.join(_SUFFIXES)}")
    if problem := output_problem(p, "file", "the output"):
        raise DataError(problem)
    p.parent.mkdir(parents=True, exist_ok=True)
    if suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(list(records)), p)
    elif suffix == ".json":
        p.write_text(json.dumps(list(records), ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    else:
        with open(p, "w", encoding="utf-8") as f:
            for r in records:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
    return len(records)


# ----------------------------------------------------------------------------------- validating


def _check_prompt(prompt: Any, key: str) -> str | None:
    """Return a problem message, or None if ``prompt`` is a valid prompt."""
    if prompt is None:
        return f"{key!r} is null"
    if isinstance(prompt, str):
        return None if prompt.strip() else f"empty prompt ({key!r} is an empty string)"
    if isinstance(prompt, list):
        if not prompt:
            return f"empty prompt ({key!r} is an empty list of messages)"
        for j, m in enumerate(prompt):
            if not isinstance(m, dict):
                return f"{key!r} message {j} is a {type(m).__name__}, expected an object with 'role' and 'content'"
            if "role" not in m:
                return f"{key!r} message {j} has no 'role'"
            if m["role"] not in VALID_ROLES:
                return f"{key!r} message {j} has bad role {m['role']!r}; expected one of {sorted(VALID_ROLES)}"
            if "content" not in m:
                return f"{key!r} message {j} has no 'content'"
            if not isinstance(m["content"], str):
                return (
                    f"{key!r} message {j} content is a {type(m['content']).__name__}, expected a string (multimodal "
                    "content parts are not supported)"
                )
        if not any(m["content"].strip() for m in prompt):
            return f"empty prompt (every message in {key!r} has empty content)"
        return None
    return f"{key!r} is a {type(prompt).__name__}, expected a string or a list of chat messages"


def _row_from_record(
    rec: Any,
    index: int,
    locator: str = "",
    *,
    default_data_source: str,
    prompt_key: str,
    response_key: str | None,
    score_key: str | None,
) -> PromptRow | str:
    """Build a row, or return a problem message."""
    problem = not_an_object(rec)
    if problem:
        return problem
    if prompt_key not in rec:
        hint = ""
        if "question" in rec and "answer" in rec:
            hint = " (this looks like raw GSM8K; convert it with `tether data gsm8k SRC OUT`)"
        keys = ", ".join(sorted(map(str, rec)))[:200]
        return f"missing prompt: no {prompt_key!r} field (fields: {keys}){hint}"
    prompt = rec[prompt_key]
    problem = _check_prompt(prompt, prompt_key)
    if problem:
        return problem

    ds = rec.get("data_source")
    if ds is None:
        ds = default_data_source
    elif not isinstance(ds, str) or not ds:
        return f"'data_source' must be a non-empty string, got {ds!r}"

    rm = rec.get("reward_model")
    if rm is None:
        gt = rec.get("ground_truth")
    elif isinstance(rm, dict):
        gt = rm.get("ground_truth")
    else:
        return f"'reward_model' must be an object with 'style' and 'ground_truth', got {type(rm).__name__}"

    extra = rec.get("extra_info")
    if extra is None:
        extra = {}
    elif not isinstance(extra, dict):
        return f"'extra_info' must be an object, got {type(extra).__name__}"
    else:
        extra = dict(extra)
    known = {prompt_key, "data_source", "reward_model", "extra_info", "ground_truth", response_key, score_key}
    for k, v in rec.items():
        if k not in known and k not in extra:
            extra[k] = v

    response = None
    if response_key is not None:
        if response_key not in rec:
            return f"missing response: no {response_key!r} field"
        response = rec[response_key]
        if not isinstance(response, str):
            return f"{response_key!r} is a {type(response).__name__}, expected a string"
    score = None
    if score_key is not None:
        if score_key not in rec:
            return f"missing score: no {score_key!r} field"
        s = rec[score_key]
        if s is not None:
            if isinstance(s, bool) or not isinstance(s, (int, float)):
                return f"{score_key!r} is {s!r}, expected a number or null"
            if not math.isfinite(s):
                return f"{score_key!r} is {s!r}, expected a finite number"
            score = float(s)
    if isinstance(prompt, list):
        prompt = [dict(m) for m in prompt]
    return PromptRow(
        prompt=prompt,
        data_source=ds,
        ground_truth=gt,
        extra_info=extra,
        index=index,
        response=response,
        score=score,
        locator=locator,
    )


def _build(
    located: list[tuple[str, Any]],
    source: str,
    *,
    default_data_source: str,
    prompt_key: str,
    response_key: str | None,
    score_key: str | None,
    skip_invalid: bool,
) -> LoadReport:
    rows: list[PromptRow] = []
    problems: list[str] = []
    n_bad = 0
    for index, (loc, rec) in enumerate(located):
        r = _row_from_record(
            rec,
            index,
            loc,
            default_data_source=default_data_source,
            prompt_key=prompt_key,
            response_key=response_key,
            score_key=score_key,
        )
        if isinstance(r, str):
            n_bad += 1
            if len(problems) < MAX_REPORTED_ERRORS:
                problems.append(f"{_where(source, loc)}: {r}")
        else:
            rows.append(r)
    if n_bad and not skip_invalid:
        more = f"\n  ... and {n_bad - len(problems)} more" if n_bad > len(problems) else ""
        raise DataError(
            f"{source}: {n_bad} malformed row(s) of {len(located)} (fix them, or load with "
            f"data.skip_invalid=true (skip_invalid=True in Python) to drop them):\n  " + "\n  ".join(problems) + more,
            problems,
            n_bad,
        )
    if not rows:
        if n_bad:
            raise DataError(
                f"{source}: empty dataset: all {n_bad} row(s) are malformed; first: {problems[0]}", problems, n_bad
            )
        raise DataError(f"{source}: empty dataset (no rows)")
    return LoadReport(rows=rows, n_skipped=n_bad, problems=problems, source=source)


def rows_from_records(
    records: Sequence[dict],
    source: str,
    *,
    default_data_source: str = "unknown",
    prompt_key: str = "prompt",
    response_key: str | None = None,
    score_key: str | None = None,
    skip_invalid: bool = False,
) -> list[PromptRow]:
    """Validate in-memory records (e.g. verl-schema dicts made by a task) and build rows.

    Args:
        records: the records, in order. ``index`` of each row is its position here.
        source: a name for error messages (e.g. ``"tether/digitsum"``); problems are reported as
            ``"<source>: record N: ..."`` with N 1-based.
        default_data_source, prompt_key, response_key, score_key, skip_invalid: as in
            :func:`load_rows`.

    Returns:
        The rows.

    Raises:
        DataError: malformed records (unless ``skip_invalid``), or no valid rows.
    """
    located = [(f"record {i}", r) for i, r in enumerate(records, start=1)]
    rep = _build(
        located,
        source,
        default_data_source=default_data_source,
        prompt_key=prompt_key,
        response_key=response_key,
        score_key=score_key,
        skip_invalid=skip_invalid,
    )
    _warn_skipped(rep)
    return rep.rows


def load_rows_report(
    path: str | Path,
    *,
    default_data_source: str = "unknown",
    prompt_key: str = "prompt",
    response_key: str | None = None,
    score_key: str | None = None,
    skip_invalid: bool = False,
) -> LoadReport:
    """Like :func:`load_rows`, but return a :class:`LoadReport` with the skipped count and problems
    instead of warning."""
    located = read_records(path)
    return _build(
        located,
        str(path),
        default_data_source=default_data_source,
        prompt_key=prompt_key,
        response_key=response_key,
        score_key=score_key,
        skip_invalid=skip_invalid,
    )


def _warn_skipped(rep: LoadReport) -> None:
    if rep.n_skipped:
        first = "; ".join(rep.problems[:3])
        log.warning("%s: skipped %d malformed row(s); first: %s", rep.source, rep.n_skipped, first)


def load_rows(
    path: str | Path,
    *,
    default_data_source: str = "unknown",
    prompt_key: str = "prompt",
    response_key: str | None = None,
    score_key: str | None = None,
    skip_invalid: bool = False,
) -> list[PromptRow]:
    """Load a prompt dataset from ``.jsonl``, ``.json`` (list of objects) or ``.parquet``.

    Args:
        path: the file.
        default_data_source: ``data_source`` for rows that have none (plain prompt files).
        prompt_key: the column holding the prompt (verl: ``prompt``).
        response_key: for offline data, the column holding a fixed response (required per row).
        score_key: for offline data, the column holding the response's reward (number or null).
        skip_invalid: drop malformed rows instead of failing; a warning on the ``tether`` logger gives the count
            and the first problems (use :func:`load_rows_report` to get them as data).

    Returns:
        The rows, in file order.

    Raises:
        DataError: missing file, unsupported extension, a file that is not what its extension says,
            malformed rows (each named by file and 1-based line / record number, the first
            :data:`MAX_REPORTED_ERRORS` listed) unless ``skip_invalid``, or an empty dataset.
    """
    rep = load_rows_report(
        path,
        default_data_source=default_data_source,
        prompt_key=prompt_key,
        response_key=response_key,
        score_key=score_key,
        skip_invalid=skip_invalid,
    )
    _warn_skipped(rep)
    return rep.rows


# ----------------------------------------------------------------------------------- splitting


def split_rows(
    rows: Sequence[PromptRow], val_fraction: float, seed: int = 0
) -> tuple[list[PromptRow], list[PromptRow]]:
    """Deterministic train / validation split.

    ``n_val = round(len(rows) * val_fraction)``, at least 1 when ``val_fraction > 0``, and at most
    ``len(rows) - 1`` so training keeps a row. The validation rows are chosen by shuffling positions
    with ``random.Random(seed)`` (independent of torch / numpy global state); both parts keep the
    input order.

    Args:
        rows: the rows to split.
        val_fraction: fraction in ``[0, 1)`` for validation.
        seed: the shuffle seed; the same rows and seed give the same split.

    Returns:
        ``(train_rows, val_rows)``; ``val_rows`` is empty when ``val_fraction == 0``.

    Raises:
        ValueError: ``val_fraction`` outside ``[0, 1)``, or ``val_fraction > 0`` with fewer than
            two rows.
    """
    if not (0.0 <= val_fraction < 1.0):
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    n = len(rows)
    if val_fraction == 0.0:
        return list(rows), []
    if n < 2:
        raise ValueError(f"cannot split {n} row(s) into non-empty train and validation parts")
    n_val = min(max(1, round(n * val_fraction)), n - 1)
    order = list(range(n))
    random.Random(seed).shuffle(order)
    val_pos = set(order[:n_val])
    train = [r for i, r in enumerate(rows) if i not in val_pos]
    val = [r for i, r in enumerate(rows) if i in val_pos]
    return train, val
