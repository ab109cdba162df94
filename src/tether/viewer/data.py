"""What ``tether view`` shows, read from a run directory: curves, events, findings and the rollout records.

The page gets a light **index** of every recorded response (one number per column and response: step, kind,
data source, reward, gold, length, KL, prompt) to filter and sort in the browser, and fetches the
token-level **details** of the responses it shows (:func:`sample_details`), so the first page of a run with
100k recorded responses needs the index and one page of details only.
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads
import pyarrow.parquet as pq

from tether.diagnostics import diagnose, load_run_config, read_metrics
from tether.records import RECORDS_DIR, SCHEMA, record_files

#: the curves drawn, by label: the metric each reads from metrics.jsonl
CURVES: dict[str, str] = {
    "reward": "reward/score_mean",
    "gold": "val/gold_mean",
    "val score": "val/score_mean",
    "KL (nats/token)": "kl/ref_mean",
    "entropy (nats)": "policy/entropy",
    "β": "kl/coef",
}
#: guard/* keys that are states or running counts, not events (an event is any other guard/* key above 0)
_GUARD_STATES = ("guard/coef_scale", "guard/coef_floor", "guard/rollbacks", "guard/nonfinite_weights")
#: guard/* keys that report what PPO does by design, not a fault: left off the timeline
_GUARD_INFO = ("guard/early_stop",)
#: the per-token columns a response can be coloured by
COLOUR_BY = ("kl", "advantages", "entropy", "logprobs")
_DETAIL_COLUMNS = (
    "tokens",
    "response_ids",
    "logprobs",
    "ref_logprobs",
    "kl",
    "entropy",
    "advantages",
    "rollout_logprobs",
    "is_weights",
    "response_mask",
    "generated_mask",
    "loss_mask",
)
HOW_TO_RECORD = "set trainer.log_rollouts=N (record every N steps; trainer.log_rollouts_k responses each) and train"


class ViewError(ValueError):
    """The run directory cannot be shown (missing, or no metrics and no records): one line, what to do."""


#: the columns the index is built from; the rest are read per page (:func:`sample_details`)
INDEX_COLUMNS = ("step", "kind", "data_source", "prompt", "reward", "gold", "response_ids", *COLOUR_BY)
_OPEN_FILES = 16  # record files kept in memory for sample_details


@dataclass
class RunView:
    """A run directory, read once: ``table`` holds the index columns of every record (None without any); sample
    id i is row i, found in ``files[j]`` at row ``i - offsets[j]``."""

    run_dir: Path
    history: list[dict]
    table: pa.Table | None
    problems: list[str] = field(default_factory=list)
    findings: list = field(default_factory=list)
    files: list[Path] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    _open: dict = field(default_factory=dict, repr=False)

    @property
    def n_samples(self) -> int:
        return 0 if self.table is None else self.table.num_rows

    def rows(self, ids: list[int]) -> list[dict]:
        """Full records of sample ids (each in range), read from their files (the last few kept open)."""
        out = []
        for i in ids:
            j = bisect.bisect_right(self.offsets, i) - 1
            path = self.files[j]
            if path not in self._open:
                if len(self._open) >= _OPEN_FILES:
                    self._open.pop(next(iter(self._open)))
                self._open[path] = pq.read_table(path, schema=SCHEMA)
            out.append(self._open[path].slice(i - self.offsets[j], 1).to_pylist()[0])
        return out


def _index_table(run: Path) -> tuple[pa.Table | None, list[Path], list[int], list[str]]:
    """The index columns of every readable record file, the files, each file's first sample id, and a line per
    file skipped (corrupt, truncated, or of another schema)."""
    files, offsets, problems, n = [], [], [], 0
    for _, path in record_files(run):
        try:
            meta = pq.read_metadata(path)
            if not meta.schema.to_arrow_schema().equals(SCHEMA, check_metadata=False):
                raise ValueError("its columns are not those of tether.records.SCHEMA")
        except (OSError, pa.ArrowException, ValueError) as e:
            problems.append(f"{path}: not a readable record file ({str(e).splitlines()[0][:200]}); skipped")
            continue
        files.append(path)
        offsets.append(n)
        n += meta.num_rows
    if not files:
        return None, [], [], problems
    # one multi-threaded scan of the index columns, files in order (100k responses: about a second)
    table = pads.dataset([str(f) for f in files], schema=SCHEMA, format="parquet").to_table(columns=list(INDEX_COLUMNS))
    return table, files, offsets, problems


def load_run(run_dir: str | Path) -> RunView:
    """Read ``run_dir``'s metrics.jsonl, config.yaml (for the doctor's advice) and rollout records.

    A corrupt or truncated record file is skipped and named in ``problems``; a file being written is not
    seen (records are renamed into place whole). Raises :class:`ViewError` for a missing directory or one
    with neither metrics nor records.
    """
    run = Path(run_dir)
    if not run.is_dir():
        what = "no such directory" if not run.exists() else "not a directory"
        raise ViewError(f"{run}: {what} (give a run directory: trainer.output_dir of a tether train)")
    history = read_metrics(run) if (run / "metrics.jsonl").exists() else []
    table, files, offsets, problems = _index_table(run)
    if not history and table is None:
        raise ViewError(f"{run}: no metrics.jsonl and no {RECORDS_DIR}/ (is it a tether run directory?)")
    findings = diagnose(history, config=load_run_config(run)) if history else []
    return RunView(run, history, table, problems, findings, files, offsets)


def _finite(v) -> float | None:
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None


def curves(history: list[dict]) -> dict[str, list[list[float]]]:
    """``{label: [[step, value], ...]}`` of :data:`CURVES` present in the history (NaN/null points left out)."""
    out = {}
    for label, key in CURVES.items():
        pts = [[r["step"], v] for r in history if (v := _finite(r.get(key))) is not None]
        if pts:
            out[label] = pts
    return out


def events(history: list[dict], findings) -> list[dict]:
    """Timeline marks: guard events (``kind: "guard"``: a rollback, a KL explosion, a skipped update, a stop: each
    ``guard/*`` key above 0 but the states and the target-KL early stop, which PPO does by design) and doctor findings
    (``kind: "doctor"``, at the last step of their evidence), each ``{step, kind, text}``."""
    out = []
    for r in history:
        for key, v in sorted(r.items()):
            if not key.startswith("guard/") or key in _GUARD_STATES or key in _GUARD_INFO:
                continue
            if isinstance(v, (int, float)) and math.isfinite(v) and v > 0:
                text = key if v == 1 else f"{key} = {v:g}"
                if key.endswith("rollback"):
                    text += f" ({int(r.get('guard/rollbacks', 0))} so far)"
                out.append({"step": r["step"], "kind": "guard", "text": text})
    for f in findings:
        steps = f.evidence.get("steps") or [0]
        text = f"{f.check}: {f.message}" + (f" — {f.suggestion}" if f.suggestion else "")
        out.append({"step": int(steps[-1]), "kind": "doctor", "text": text})
    return sorted(out, key=lambda e: (e["step"], e["kind"]))


def mean_per_response(table: pa.Table, column: str) -> list[float | None]:
    """Each response's mean of a per-token column over its finite values (None where it has none), computed
    column-wise (a 100k-response run in well under a second)."""
    arr = table.column(column).combine_chunks()
    flat, parents = pc.list_flatten(arr), pc.list_parent_indices(arr)
    keep = pc.is_finite(flat)
    sums = (
        pa.table({"i": pc.filter(parents, keep), "v": pc.filter(flat, keep)}).group_by("i").aggregate([("v", "mean")])
    )
    out: list[float | None] = [None] * table.num_rows
    for i, v in zip(sums.column("i").to_pylist(), sums.column("v_mean").to_pylist(), strict=True):
        out[i] = v
    return out


def index(view: RunView) -> dict:
    """The columnar index of every record (row i of the table is sample id i), with the lists its integer codes
    point into: ``sources``, ``prompts``; and ``scales``, the colour scale of each :data:`COLOUR_BY` column (the
    99th percentile of |value| over every recorded token, so a colour means the same on every page)."""
    t = view.table
    if t is None:
        return {"n": 0}
    sources = t.column("data_source").to_pylist()
    prompts = t.column("prompt").to_pylist()
    src_list, prompt_list = list(dict.fromkeys(sources)), list(dict.fromkeys(prompts))
    src_code, prompt_code = {s: i for i, s in enumerate(src_list)}, {p: i for i, p in enumerate(prompt_list)}
    return {
        "n": t.num_rows,
        "step": t.column("step").to_pylist(),
        "kind": t.column("kind").to_pylist(),
        "source": [src_code[s] for s in sources],
        "prompt": [prompt_code[p] for p in prompts],
        "reward": [_finite(x) for x in t.column("reward").to_pylist()],
        "gold": [_finite(x) for x in t.column("gold").to_pylist()],
        "length": pc.list_value_length(t.column("response_ids")).to_pylist(),
        "kl": [_round(x) for x in mean_per_response(t, "kl")],
        "sources": src_list,
        "prompts": prompt_list,
        "scales": {c: scale(t, c) for c in COLOUR_BY},
    }


def _round(x):
    return None if x is None else float(f"{x:.6g}")


def scale(table: pa.Table, column: str) -> float:
    """The 99th percentile of |value| over every token of ``column`` (1.0 when there is none): the value the
    page paints at full strength."""
    flat = pc.list_flatten(table.column(column))
    if len(flat) == 0:
        return 1.0
    flat = pc.abs(pc.drop_null(pc.if_else(pc.is_finite(flat), flat, None)))
    if len(flat) == 0:
        return 1.0
    q = pc.quantile(flat, q=0.99, interpolation="higher").to_pylist()[0]
    return float(q) if q and q > 0 else 1.0


def sample_details(view: RunView, ids: list[int]) -> list[dict]:
    """The full records of samples ``ids`` (ids outside the run are left out): text, tokens and every per-token
    column, read from the record files."""
    ok = [i for i in ids if 0 <= i < view.n_samples]
    out = []
    for i, r in zip(ok, view.rows(ok), strict=True):
        d = {"id": i, **{k: r[k] for k in ("step", "kind", "index", "group_id", "data_source", "prompt", "response")}}
        d |= {"reward": _finite(r["reward"]), "gold": _finite(r["gold"]), "finish_reason": r["finish_reason"]}
        d |= {"truncated": r["truncated"]}
        for c in _DETAIL_COLUMNS:
            d[c] = [(_finite(x) if isinstance(x, float) else x) for x in r[c]]
        out.append(d)
    return out


def summary(view: RunView) -> dict:
    """Everything the page needs but the details: run name, counts, curves, events, problems, the index."""
    return {
        "run": view.run_dir.name or str(view.run_dir),
        "run_dir": str(view.run_dir),
        "curves": curves(view.history),
        "events": events(view.history, view.findings),
        "problems": view.problems,
        "how_to_record": HOW_TO_RECORD,
        "colour_by": list(COLOUR_BY),
        "index": index(view),
    }


def to_json(obj) -> str:
    """Compact JSON, safe inside an HTML ``<script>`` element (no ``</`` sequence)."""
    return json.dumps(obj, separators=(",", ":"), allow_nan=False).replace("</", "<\\/")
