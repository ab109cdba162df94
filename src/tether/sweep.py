"""``tether sweep``: a grid of ``tether train`` runs, in parallel, resumable, summarised in a table and plots.

A sweep is a list of runs. Each run is the fixed overrides plus one point of the grid (the cartesian
product of the ``grid`` values, times each entry of ``configs``). Every run is an ordinary
``tether train`` subprocess writing into ``<out>/<name>``, where ``<name>`` spells the run's own
(varying) overrides, e.g. ``kl.coef=0.05__kl.controller=adaptive``.

Resuming. When a run exits with status 0 the sweep writes ``<run>/sweep_done.json`` holding the run's
full override list. A later sweep over the same ``<out>`` skips every run whose marker holds the same
overrides (a run without a marker whose final checkpoint ``checkpoints/step_<total_steps>`` verifies
is also taken as finished), and starts every other run with ``trainer.resume=auto``, so an
interrupted run continues from its latest complete checkpoint and a run whose ``trainer.total_steps``
was raised continues where it stopped.

Summary. After the runs, each finished run's final checkpoint can be evaluated exactly on the
embedded task (``exact_final``: the val prompts, the train prompts or all 20; written to
``<run>/exact_final.json``), and the sweep writes ``table.csv`` / ``table.md`` (one row per run: final
reward, KL per token, diversity, collapse rate, exact objective, the optimum's objective and the gap)
and two plots, ``reward_vs_kl.png`` and ``reward_vs_diversity.png``, on which the exact optimum's curve
β ↦ (KL*(β), E_{π*}[r](β)) is drawn from enumeration of the shipped reference
(:func:`optimum_curve`). See ``docs/sweep.md``.
"""

from __future__ import annotations

import csv
import hashlib
import itertools
import json
import math
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tether.checkpoint import CheckpointError, step_dir_name, verify_checkpoint
from tether.config import ConfigError, TrainerConfig, load_config, parse_override
from tether.diagnostics import read_metrics
from tether.evaluation.exact import EXACT_FINAL, evaluate_final, exact_prompts
from tether.outputs import output_problem
from tether.tasks import digitsum
from tether.tasks.exact import _prompt_spec, entropy, enumerate_policy, exact_kl_per_token, exact_optimum
from tether.tasks.sft import load_reference

DONE_MARKER = "sweep_done.json"
"""Written into a run directory when its ``tether train`` exited with status 0."""


SPEC_KEYS = {"grid", "fixed", "configs", "out", "workers", "tail", "exact_final"}

#: Fixed overrides the sweep adds unless the spec sets them itself.
SWEEP_DEFAULTS = {"trainer.progress": False, "trainer.report": False}

_NAME_MAX = 120

#: Keys the sweep sets itself for every run; setting them is an error (see :func:`expand_grid`).
SWEEP_OWNED = {"trainer.output_dir"}


class SweepError(ValueError):
    """A sweep spec is malformed. The message names the offending item."""


# ----------------------------------------------------------------------------------------------
# values, overrides and names


def format_value(value: Any) -> str:
    """A value as it appears on a ``tether train`` command line (YAML that parses back to ``value``).

    Plain strings stay bare when YAML reads them back unchanged (``fixed``), otherwise they are quoted;
    numbers, booleans, ``null`` and lists use JSON spelling (``0.05``, ``true``, ``[[50, 0.08]]``).
    """
    if isinstance(value, str):
        try:
            if yaml.safe_load(value) == value and value.strip() == value and value != "":
                return value
        except yaml.YAMLError:
            pass
        return json.dumps(value)
    if isinstance(value, tuple):
        value = list(value)
    return json.dumps(value)


def split_values(raw: str) -> list[Any]:
    """Split ``"0,0.01,[1,2],fixed"`` on the commas outside brackets/quotes; parse each item as YAML.

    Raises:
        SweepError: unbalanced brackets or an empty item.
    """
    items, depth, cur, quote = [], 0, [], None
    for ch in raw:
        if quote:
            cur.append(ch)
            if ch == quote:
                quote = None
            continue
        if ch in "\"'":
            quote = ch
        elif ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
            if depth < 0:
                raise SweepError(f"unbalanced brackets in grid values {raw!r}")
        if ch == "," and depth == 0:
            items.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth != 0 or quote:
        raise SweepError(f"unbalanced brackets or quotes in grid values {raw!r}")
    items.append("".join(cur))
    out = []
    for item in items:
        if not item.strip():
            raise SweepError(f"empty value in grid values {raw!r}")
        try:
            out.append(yaml.safe_load(item))
        except yaml.YAMLError:
            out.append(item.strip())
    return out


def parse_grid_arg(text: str) -> tuple[str, list[Any]]:
    """``"kl.coef=0,0.05,0.1"`` → ``("kl.coef", [0, 0.05, 0.1])``.

    Raises:
        SweepError: no ``=`` or an empty key or value list.
    """
    if "=" not in text:
        raise SweepError(f"--grid {text!r} is not of the form key=v1,v2,... (e.g. kl.coef=0,0.05,0.1)")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or not raw.strip():
        raise SweepError(f"--grid {text!r} needs a key and at least one value")
    return key, split_values(raw)


_UNSAFE = r"[^A-Za-z0-9._=,+\-]+"


def _slug(text: str) -> str:
    """``text`` with unsafe characters dropped at the ends and turned into ``-`` inside.

    Only what was unsafe is dropped, so a value's own minus sign stays (``-0.01`` → ``-0.01``).
    """
    inner = re.sub(rf"^{_UNSAFE}|{_UNSAFE}$", "", text)
    return re.sub(_UNSAFE, "-", inner)


def run_name(overrides: Sequence[tuple[str, Any]]) -> str:
    """The directory name of a run: its varying overrides as ``key=value`` joined by ``__``.

    Characters outside ``[A-Za-z0-9._=,+-]`` become ``-`` (``[[50, 0.08]]`` → ``50,0.08``); a name
    longer than 120 characters is cut and given an 8-hex-digit hash of the full overrides, so names
    stay unique. No overrides: ``default``.
    """
    if not overrides:
        return "default"
    name = "__".join(f"{k}={_slug(format_value(v))}" for k, v in overrides)
    if len(name) > _NAME_MAX:
        digest = hashlib.sha1(
            json.dumps([[k, v] for k, v in overrides], sort_keys=True, default=str).encode()
        ).hexdigest()[:8]
        name = name[: _NAME_MAX - 9].rstrip("_-.") + "-" + digest
    return name


@dataclass(frozen=True)
class RunSpec:
    """One run of a sweep: its name, its varying overrides and the sweep's fixed ones."""

    name: str
    overrides: tuple[tuple[str, Any], ...]
    fixed: tuple[tuple[str, Any], ...] = ()

    @property
    def all_overrides(self) -> dict[str, Any]:
        """Fixed then varying overrides as one mapping (a varying key wins)."""
        return dict(self.fixed) | dict(self.overrides)

    def args(self) -> list[str]:
        """``key=value`` arguments for ``tether train`` (without the output directory)."""
        return [f"{k}={format_value(v)}" for k, v in self.all_overrides.items()]

    def label(self, keys: Mapping[str, str] | None = None) -> str:
        """Label for plots: the varying overrides as ``key=value`` joined by ``, ``
        (``kl.coef=0.05, kl.controller=adaptive``).

        ``keys`` maps a key to the name shown for it (see :func:`plot_labels`); a key not in it is shown whole.
        """
        keys = keys or {}
        return ", ".join(f"{keys.get(k, k)}={format_value(v)}" for k, v in self.overrides) or "default"


def plot_labels(runs: Sequence[RunSpec]) -> dict[str, str]:
    """Legend labels of a sweep's runs by name: :meth:`RunSpec.label` with short keys.

    A key is shown as its last two dotted parts (``algo.rollout_correction.level`` →
    ``rollout_correction.level``), or as many more as tell it apart from the sweep's other varying
    keys; a key every run sets to the same value is left out when there are several runs.
    """
    keys = list(dict.fromkeys(k for r in runs for k, _ in r.overrides))
    constant = {
        k
        for k in keys
        if len(runs) > 1 and len({(k in dict(r.overrides), format_value(dict(r.overrides).get(k))) for r in runs}) == 1
    }
    short = {}
    for k in keys:
        parts = k.split(".")
        for n in range(min(2, len(parts)), len(parts) + 1):
            short[k] = ".".join(parts[-n:])
            if not any(o != k and (o == short[k] or o.endswith("." + short[k])) for o in keys):
                break
    out = {}
    for r in runs:
        shown = tuple((k, v) for k, v in r.overrides if k not in constant)
        out[r.name] = RunSpec(r.name, shown or r.overrides).label(short)
    return out


def _as_pairs(obj: Any, where: str) -> list[tuple[str, Any]]:
    if obj is None:
        return []
    if isinstance(obj, Mapping):
        return [(str(k), v) for k, v in obj.items()]
    if isinstance(obj, (list, tuple)):
        pairs = []
        for item in obj:
            if isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str):
                pairs.append((item[0], item[1]))
                continue
            if not isinstance(item, str):
                raise SweepError(f"{where}: expected 'key=value' strings, got {item!r}")
            try:
                pairs.append(parse_override(item))
            except ConfigError as e:
                raise SweepError(f"{where}: {e}") from None
        return pairs
    raise SweepError(f"{where} must be a mapping or a list of key=value strings, got {type(obj).__name__}")


def expand_grid(
    grid: Mapping[str, Sequence[Any]] | Sequence[tuple[str, Sequence[Any]]] = (),
    fixed: Mapping[str, Any] | Sequence[tuple[str, Any]] = (),
    configs: Sequence[Mapping[str, Any]] | None = None,
) -> list[RunSpec]:
    """The runs of a sweep: every entry of ``configs`` (default: one empty entry) combined with every
    point of the cartesian product of ``grid``, on top of ``fixed``.

    The order is ``configs`` outermost, then the grid keys in the order given with the last one varying
    fastest. A run's varying overrides are its config entry's then its grid point's; its name comes
    from them (:func:`run_name`). :data:`SWEEP_DEFAULTS` are added to ``fixed`` unless set there.

    Raises:
        SweepError: a grid key with no values, two runs with the same name (duplicate values), or
            ``trainer.output_dir`` set anywhere (the sweep puts each run in ``<out>/<name>``).
    """
    grid_pairs = list(grid.items()) if isinstance(grid, Mapping) else [(k, list(v)) for k, v in grid]
    for key, values in grid_pairs:
        if not isinstance(values, (list, tuple)) or len(values) == 0:
            raise SweepError(f"grid key {key!r} needs a non-empty list of values, got {values!r}")
    fixed_pairs = _as_pairs(fixed, "fixed")
    fixed_keys = {k for k, _ in fixed_pairs}
    fixed_pairs += [(k, v) for k, v in SWEEP_DEFAULTS.items() if k not in fixed_keys]
    entries = list(configs) if configs else [{}]
    for where, pairs in [("grid", grid_pairs), ("fixed overrides", fixed_pairs)] + [
        (f"configs[{i}]", _as_pairs(e, f"configs[{i}]")) for i, e in enumerate(entries)
    ]:
        if any(k.lstrip("+") in SWEEP_OWNED for k, _ in pairs):
            raise SweepError(
                f"{where} sets trainer.output_dir, which the sweep owns: each run writes to <out>/<run name> (choose "
                "the sweep directory with --out DIR or 'out:' in the spec)"
            )
    runs: list[RunSpec] = []
    seen: dict[str, RunSpec] = {}
    for i, entry in enumerate(entries):
        entry_pairs = _as_pairs(entry, f"configs[{i}]")
        keys = [k for k, _ in grid_pairs]
        for point in itertools.product(*(v for _, v in grid_pairs)):
            varying = entry_pairs + [(k, v) for k, v in zip(keys, point, strict=True) if k not in dict(entry_pairs)]
            run = RunSpec(run_name(varying), tuple(varying), tuple(fixed_pairs))
            if run.name in seen:
                raise SweepError(
                    f"two runs of the sweep are both named {run.name!r} (duplicate grid values or configs?)"
                )
            seen[run.name] = run
            runs.append(run)
    return runs


@dataclass
class SweepSpec:
    """A sweep: the grid, the fixed overrides, optional explicit configs, and where/how to run it."""

    grid: list[tuple[str, list[Any]]] = field(default_factory=list)
    fixed: list[tuple[str, Any]] = field(default_factory=list)
    configs: list[dict[str, Any]] | None = None
    out: str = "runs/sweep"
    workers: int | None = None
    tail: int = 20
    exact_final: str = "all"

    def runs(self) -> list[RunSpec]:
        """The expanded runs (:func:`expand_grid`)."""
        return expand_grid(self.grid, self.fixed, self.configs)


def load_spec(
    path: str | Path | None = None, *, grid: Sequence[str] = (), fixed: Sequence[str] = (), **options: Any
) -> SweepSpec:
    """A :class:`SweepSpec` from an optional YAML file plus command-line ``--grid``/fixed overrides.

    YAML keys: ``grid`` (mapping key → list of values), ``fixed`` (mapping or list of ``key=value``),
    ``configs`` (list of mappings of overrides, each combined with the whole grid), ``out``, ``workers``,
    ``tail``, ``exact_final``. Command-line grid keys replace the file's same keys; command-line fixed
    overrides are applied after the file's. ``options`` whose value is not None override the file.

    Raises:
        SweepError: missing file, not YAML, unknown top-level key, malformed grid or overrides.
    """
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise SweepError(f"sweep spec not found: {p}")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise SweepError(f"sweep spec {p} is not valid YAML: {e}") from None
        if not isinstance(data, dict):
            raise SweepError(f"sweep spec {p} must be a mapping, got {type(data).__name__}")
        unknown = set(data) - SPEC_KEYS
        if unknown:
            raise SweepError(f"sweep spec {p}: unknown key(s) {sorted(unknown)}; valid: {sorted(SPEC_KEYS)}")
    file_grid = data.get("grid") or {}
    if not isinstance(file_grid, Mapping):
        raise SweepError("sweep spec: grid must be a mapping of key -> list of values")
    grid_d = {str(k): (list(v) if isinstance(v, (list, tuple)) else [v]) for k, v in file_grid.items()}
    for item in grid:
        key, values = parse_grid_arg(item)
        grid_d[key] = values
    fixed_pairs = _as_pairs(data.get("fixed"), "fixed") + _as_pairs(list(fixed), "fixed overrides")
    configs = data.get("configs")
    if configs is not None and (
        not isinstance(configs, list) or not all(isinstance(c, (Mapping, list)) for c in configs)
    ):
        raise SweepError("sweep spec: configs must be a list of mappings of overrides")
    spec = SweepSpec(
        grid=list(grid_d.items()),
        fixed=list(dict(fixed_pairs).items()),
        configs=[dict(_as_pairs(c, f"configs[{i}]")) for i, c in enumerate(configs)] if configs else None,
    )
    for key in ("out", "workers", "tail", "exact_final"):
        value = options.get(key)
        if value is None:
            value = data.get(key)
        if value is not None:
            setattr(spec, key, value)
    _check_workers(spec.workers)
    if spec.exact_final not in ("none", "val", "train", "all"):
        raise SweepError(f"exact_final must be none, val, train or all, got {spec.exact_final!r}")
    return spec


# ----------------------------------------------------------------------------------------------
# running


def _check_workers(workers) -> None:
    """``workers`` (parallel runs) is None (one per core) or a whole number >= 1."""
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        raise SweepError(f"workers must be a whole number >= 1 (parallel runs), got {workers!r}")


def available_cores() -> int:
    """CPU cores this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def _total_steps(run: RunSpec) -> int:
    return int(run.all_overrides.get("trainer.total_steps", TrainerConfig().total_steps))


def is_finished(run_dir: Path, run: RunSpec) -> bool:
    """True when ``run_dir`` holds a finished run of exactly ``run``'s overrides.

    Finished: a :data:`DONE_MARKER` whose ``args`` equal ``run.args()``; or, without a marker, a final
    checkpoint ``checkpoints/step_<total_steps>`` that verifies (the marker is then written).
    """
    run_dir = Path(run_dir)
    marker = run_dir / DONE_MARKER
    if marker.is_file():
        try:
            return json.loads(marker.read_text()).get("args") == run.args()
        except json.JSONDecodeError:
            return False

    final = run_dir / "checkpoints" / step_dir_name(_total_steps(run))
    if not final.is_dir():
        return False
    try:
        verify_checkpoint(final)
    except CheckpointError:
        return False
    _write_marker(run_dir, run, rc=0, wall_s=None)
    return True


def _write_marker(run_dir: Path, run: RunSpec, rc: int, wall_s: float | None) -> None:
    info = {
        "name": run.name,
        "args": run.args(),
        "overrides": [[k, v] for k, v in run.overrides],
        "rc": rc,
        "wall_s": wall_s,
        "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    (run_dir / DONE_MARKER).write_text(json.dumps(info, indent=1, default=str))


def train_command(run: RunSpec, run_dir: Path, threads: int | None = None, python: str | None = None) -> list[str]:
    """The ``tether train`` command line of a run (``trainer.resume=auto``; ``trainer.threads`` added
    when the run does not set it)."""
    args = run.args()
    if threads is not None and "trainer.threads" not in run.all_overrides:
        args.append(f"trainer.threads={threads}")
    return [
        python or sys.executable,
        "-m",
        "tether.cli",
        "train",
        *args,
        f"trainer.output_dir={run_dir}",
        "trainer.resume=auto",
    ]


@dataclass
class RunResult:
    """What happened to one run: ``status`` is ``skipped`` (already finished), ``done`` or ``failed``."""

    run: RunSpec
    run_dir: Path
    status: str
    rc: int | None = None
    wall_s: float = 0.0


def execute_run(
    run: RunSpec, run_dir: Path, threads: int | None = None, env: Mapping[str, str] | None = None
) -> RunResult:
    """Run one config as a ``tether train`` subprocess (output to ``<run_dir>/train.log``) unless finished."""
    run_dir = Path(run_dir)
    if is_finished(run_dir, run):
        return RunResult(run, run_dir, "skipped", 0)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / DONE_MARKER).unlink(missing_ok=True)
    (run_dir / EXACT_FINAL).unlink(missing_ok=True)
    cmd = train_command(run, run_dir, threads)
    t0 = time.perf_counter()
    with (run_dir / "train.log").open("a") as log:
        log.write(f"\n$ {' '.join(cmd)}\n")
        log.flush()
        rc = subprocess.run(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(env) if env is not None else None
        ).returncode
    wall = time.perf_counter() - t0
    if rc == 0:
        _write_marker(run_dir, run, rc, wall)
        return RunResult(run, run_dir, "done", rc, wall)
    return RunResult(run, run_dir, "failed", rc, wall)


def run_sweep(
    spec: SweepSpec,
    *,
    workers: int | None = None,
    dry_run: bool = False,
    summarize: bool = True,
    echo=print,
) -> list[RunResult]:
    """Run every config of ``spec`` (``workers`` at a time), then :func:`summarize_sweep`.

    Each subprocess gets ``trainer.threads = max(1, cores // workers)`` unless the spec sets it, and
    ``OMP_NUM_THREADS`` to match. ``dry_run`` only prints the commands. Returns one result per run.
    """
    out = Path(spec.out)
    runs = spec.runs()
    _check_workers(workers)
    workers = int(workers or spec.workers or available_cores())
    threads = max(1, available_cores() // workers)
    env = dict(os.environ) | {"OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    if dry_run:
        for run in runs:
            state = "finished" if is_finished(out / run.name, run) else "to run"
            echo(f"[{state}] {' '.join(train_command(run, out / run.name, threads))}")
        return [RunResult(r, out / r.name, "dry-run") for r in runs]
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.yaml").write_text(
        yaml.safe_dump(
            {
                "grid": {k: v for k, v in spec.grid},
                "fixed": dict(spec.fixed),
                "configs": spec.configs,
                "runs": [r.name for r in runs],
            },
            sort_keys=False,
        )
    )
    lock = threading.Lock()
    counter = itertools.count(1)

    def one(run: RunSpec) -> RunResult:
        res = execute_run(run, out / run.name, threads, env)
        with lock:
            i = next(counter)
            extra = f" rc={res.rc}, see {res.run_dir / 'train.log'}" if res.status == "failed" else ""
            echo(f"[{i}/{len(runs)}] {res.status:7s} {run.name} ({res.wall_s:.0f} s){extra}")
        return res

    echo(f"sweep: {len(runs)} runs in {out}, {workers} at a time, {threads} thread(s) each")
    with ThreadPoolExecutor(max_workers=workers) as pool:
        results = list(pool.map(one, runs))
    if summarize:
        summarize_sweep(out, runs, tail=spec.tail, exact_final=spec.exact_final, threads=threads, echo=echo)
    return results


# ----------------------------------------------------------------------------------------------
# exact evaluation of a finished run


def _read_yaml(path: Path) -> dict:
    try:
        return yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError):
        return {}


# ----------------------------------------------------------------------------------------------
# summary: table and plots


def _tail_mean(history: list[dict], key: str, tail: int) -> float:
    vals = [float(r[key]) for r in history if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
    if not vals:
        return float("nan")
    vals = vals[-tail:]
    return sum(vals) / len(vals)


def _last(history: list[dict], key: str) -> float:
    for rec in reversed(history):
        v = rec.get(key)
        if isinstance(v, (int, float)) and math.isfinite(v):
            return float(v)
    return float("nan")


#: Columns of table.csv: (column, description). ``exact_*`` come from exact_final.json when present,
#: else from the last logged validation's ``exact/*`` (the val prompts).
COLUMNS: list[tuple[str, str]] = [
    ("name", "run directory name (its varying overrides)"),
    ("status", "finished, incomplete or missing"),
    ("steps", "last logged step"),
    ("beta", "final β (kl/coef)"),
    ("reward", "reward/score_mean, mean of the last `tail` steps (train prompts, sampled)"),
    ("val_score", "val/score_mean at the last validation"),
    (
        "val_gold",
        "val/gold_mean at the last validation (the gold reward's score of the same samples; – without a gold reward)",
    ),
    ("val_gold_gap", "val/gold_gap at the last validation (val/score_mean − val/gold_mean)"),
    ("kl_tok", "kl/ref_mean, mean of the last `tail` steps (nats/token, the configured estimator)"),
    ("kl_k1_tok", "kl/ref_mean_unclamped (k1), mean of the last `tail` steps"),
    ("entropy", "policy/entropy, mean of the last `tail` steps (nats/token)"),
    ("unique_frac", "diversity/unique_frac, mean of the last `tail` steps"),
    ("collapse_rate", "diversity/collapse_rate, mean of the last `tail` steps"),
    ("val_collapse_rate", "val/collapse_rate at the last validation"),
    ("exact_source", "prompts of the exact_* columns: all/train/val from exact_final.json, or 'val (log)'"),
    ("exact_score", "E_π[r], exact"),
    ("exact_kl_tok", "KL(π‖π_ref) per token, exact"),
    ("exact_kl_seq", "KL(π‖π_ref) per response, exact"),
    ("opt_kl_seq", "KL(π*‖π_ref) per response at the run's final β"),
    ("opt_score", "E_{π*}[r]"),
    ("objective", "E_π[r] − β·KL_seq, exact"),
    ("opt_objective", "the optimum's objective"),
    ("objective_gap", "opt_objective − objective (≥ 0)"),
    ("kl_opt_seq", "KL(π‖π*) per response (= gap/β)"),
    ("correct_eff_answers", "exp entropy of π restricted to correct answers"),
    ("opt_correct_eff_answers", "same for π* (= π_ref's)"),
    ("effective_answers", "exp H(π)"),
    ("exact_collapse", "exact collapse_rate@n = Σ π(y)^n, n = rollout.n"),
    ("exact_unique_frac", "exact unique_frac@n"),
]


def summarize_run(
    run_dir: Path, run: RunSpec | None = None, tail: int = 20, exact: Mapping[str, float] | None = None
) -> dict[str, Any]:
    """One table row (keys of :data:`COLUMNS`, plus the run's overrides) from a run directory's files.

    ``exact``: metrics of :func:`evaluate_final` (preferred); otherwise the last logged ``exact/*``.
    Missing values are NaN; ``status`` is ``finished`` (done marker), ``incomplete`` or ``missing``.
    """
    run_dir = Path(run_dir)
    row: dict[str, Any] = {"name": run.name if run else run_dir.name}
    if run is not None:
        row |= {k: format_value(v) for k, v in run.overrides}
    try:
        history = read_metrics(run_dir)
    except (FileNotFoundError, OSError):
        history = []
    finished = run.args() == _marker_args(run_dir) if run is not None else (run_dir / DONE_MARKER).is_file()
    row["status"] = "finished" if finished else ("incomplete" if history else "missing")
    row["steps"] = history[-1]["step"] if history else 0
    row["beta"] = _last(history, "kl/coef")
    for col, key in [
        ("reward", "reward/score_mean"),
        ("kl_tok", "kl/ref_mean"),
        ("kl_k1_tok", "kl/ref_mean_unclamped"),
        ("entropy", "policy/entropy"),
        ("unique_frac", "diversity/unique_frac"),
        ("collapse_rate", "diversity/collapse_rate"),
    ]:
        row[col] = _tail_mean(history, key, tail)
    row["val_score"] = _last(history, "val/score_mean")
    row["val_gold"] = _last(history, "val/gold_mean")
    row["val_gold_gap"] = _last(history, "val/gold_gap")
    row["val_collapse_rate"] = _last(history, "val/collapse_rate")
    if exact is not None:
        ex, row["exact_source"] = dict(exact), exact.get("_prompts", "final")
    else:
        last = next((rec for rec in reversed(history) if "exact/score_mean" in rec), None)
        ex = {k: v for k, v in (last or {}).items() if k.startswith("exact/")}
        row["exact_source"] = "val (log)" if ex else ""
    n_key = next((k for k in ex if k.startswith("exact/collapse_rate@")), None)
    mapping = {
        "exact_score": "exact/score_mean",
        "exact_kl_tok": "exact/kl_ref_tok",
        "exact_kl_seq": "exact/kl_ref_seq",
        "opt_kl_seq": "exact/opt_kl_ref_seq",
        "opt_score": "exact/opt_score_mean",
        "objective": "exact/objective",
        "opt_objective": "exact/opt_objective",
        "objective_gap": "exact/objective_gap",
        "kl_opt_seq": "exact/kl_opt_seq",
        "correct_eff_answers": "exact/correct_effective_answers",
        "opt_correct_eff_answers": "exact/opt_correct_effective_answers",
        "effective_answers": "exact/effective_answers",
    }
    for col, key in mapping.items():
        v = ex.get(key)
        row[col] = float(v) if isinstance(v, (int, float)) else float("nan")
    row["exact_collapse"] = float(ex[n_key]) if n_key else float("nan")
    u_key = n_key.replace("collapse_rate", "unique_frac") if n_key else None
    row["exact_unique_frac"] = float(ex[u_key]) if u_key and u_key in ex else float("nan")
    return row


def _marker_args(run_dir: Path) -> list[str] | None:
    try:
        return json.loads((Path(run_dir) / DONE_MARKER).read_text()).get("args")
    except (OSError, json.JSONDecodeError):
        return None


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        if math.isnan(v):
            return "–"
        if v != 0 and (abs(v) >= 1e4 or abs(v) < 1e-3):
            return f"{v:.2e}"
        return f"{v:.3f}" if abs(v) < 100 else f"{v:.1f}"
    return str(v)


#: Columns shown in table.md (all of COLUMNS go to table.csv).
MD_COLUMNS = [
    ("status", "status"),
    ("beta", "β final"),
    ("reward", "reward (train, tail)"),
    ("kl_tok", "KL/tok (sampled, tail)"),
    ("exact_score", "E_π[r] exact"),
    ("exact_kl_tok", "KL/tok exact"),
    ("exact_kl_seq", "KL/seq exact"),
    ("opt_kl_seq", "KL*/seq"),
    ("objective", "objective"),
    ("opt_objective", "optimum"),
    ("objective_gap", "gap"),
    ("kl_opt_seq", "KL(π‖π*)"),
    ("unique_frac", "unique frac (tail)"),
    ("correct_eff_answers", "correct answers (eff.)"),
    ("opt_correct_eff_answers", "π*: correct (eff.)"),
    ("collapse_rate", "collapse (sampled, tail)"),
    ("exact_collapse", "collapse@n exact"),
]
#: Shown in table.md after MD_COLUMNS when some run has a gold reward (reward.val_function / val_model, or a built-in
#: gold).
MD_GOLD_COLUMNS = [("val_score", "val score"), ("val_gold", "val gold"), ("val_gold_gap", "val gap (score − gold)")]


def write_table(rows: Sequence[Mapping[str, Any]], out: Path, varying: Sequence[str] = ()) -> tuple[Path, Path]:
    """Write ``table.csv`` (every column) and ``table.md`` (the main ones) into ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cols = ["name", *varying, *[c for c, _ in COLUMNS if c != "name"]]
    with (out / "table.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({c: r.get(c, "") for c in cols})
    gold = any(isinstance(r.get("val_gold"), float) and math.isfinite(r["val_gold"]) for r in rows)
    md_cols = MD_COLUMNS + (MD_GOLD_COLUMNS if gold else [])
    head = ["run", *[h for _, h in md_cols]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join([f"`{r['name']}`", *[_fmt(r.get(c, float("nan"))) for c, _ in md_cols]]) + " |")
    src = sorted({str(r.get("exact_source")) for r in rows if r.get("exact_source")})
    notes = [
        "",
        f"Exact columns: enumeration on the embedded task's prompts ({', '.join(src) or 'none'}), at each run's final "
        "β. Sampled columns: mean of the last `tail` logged steps. KL in nats (per token or per response). collapse: "
        "share of prompts whose n samples are all identical; collapse@n exact = Σ_y π(y)^n.",
        "",
    ]
    if gold:
        notes[-1:] = [
            "val score / val gold: the training reward's and the gold reward's mean on the same validation samples at "
            "the last validation (val/score_mean, val/gold_mean); gap = score − gold "
            "(docs/rewards.md#gold-reward-for-validation).",
            "",
        ]
    (out / "table.md").write_text("\n".join(lines + notes))
    return out / "table.csv", out / "table.md"


def optimum_curve(
    prompts: Sequence[str],
    betas: Iterable[float],
    *,
    temperature: float = 1.0,
    n_samples: int = 8,
    ref_cache: dict | None = None,
) -> list[dict[str, float]]:
    """The exact optimum π*_β of the shipped reference for each β, averaged over ``prompts``.

    Returns one dict per β: ``beta``, ``kl_tok`` (per-token KL(π*‖π_ref), the trainer's kl/ref_mean
    unit), ``kl_seq``, ``reward`` E_{π*}[r], ``value`` (the optimal objective), ``effective_answers``
    exp H(π*), ``correct_effective_answers``, ``unique_frac`` (exact, n = ``n_samples``) and
    ``collapse`` (Σ π*(y)^n).
    """
    import numpy as np

    ref, tok = load_reference()
    spaces = []
    for text in prompts:
        text, gt, extra, T = _prompt_spec(text, None, digitsum.compute_score)
        key = (text, T, float(temperature))
        space = ref_cache.get(key) if ref_cache is not None else None
        if space is None:
            space = enumerate_policy(ref, tok, text, T, temperature)
            if ref_cache is not None:
                ref_cache[key] = space
        spaces.append((space, space.rewards(digitsum.compute_score, gt, extra)))
    out = []
    for beta in betas:
        acc: dict[str, list[float]] = {}
        for space, r in spaces:
            opt = exact_optimum(space.logprobs, r, float(beta))
            p = np.exp(opt.logprobs)
            best = r >= r.max() - 1e-12
            sub = opt.logprobs[best] - np.logaddexp.reduce(opt.logprobs[best])
            vals = {
                "kl_tok": exact_kl_per_token(opt.logprobs, space.logprobs, space.lengths),
                "kl_seq": opt.kl,
                "reward": opt.expected_reward,
                "value": opt.value,
                "effective_answers": math.exp(entropy(opt.logprobs)),
                "correct_effective_answers": math.exp(entropy(sub)),
                "unique_frac": float(np.sum(-np.expm1(n_samples * np.log1p(-np.minimum(p, 1.0)))) / n_samples),
                "collapse": float(np.sum(p**n_samples)),
            }
            for k, v in vals.items():
                acc.setdefault(k, []).append(v)
        out.append({"beta": float(beta)} | {k: float(np.mean(v)) for k, v in acc.items()})
    return out


CURVE_BETAS = [0.0, 0.01, 0.03, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.7, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 100.0]


#: β values of the optimum's curve that get a ``β=…`` label, where it does not overlap one already placed.
CURVE_LABEL_BETAS = (0.05, 0.1, 0.3, 0.5, 1.0, 2.0)


#: Least distance, in points, between two labelled points of the optimum's curve.
CURVE_LABEL_SEP = 14.0


def _label_curve(ax, curve: Sequence[Mapping[str, float]], xkey: str) -> None:
    """Annotate the curve's points at :data:`CURVE_LABEL_BETAS` with ``β=…``, below right of the point
    (below left in the right fifth of the axes) or else above it. A point closer than
    :data:`CURVE_LABEL_SEP` to one already labelled, or whose label would overlap one already placed
    in both spots, gets none. Call once the figure's layout is final.
    """
    fig = ax.figure
    renderer = fig.canvas.get_renderer()
    to_axes = ax.transData + ax.transAxes.inverted()
    sep = CURVE_LABEL_SEP * fig.dpi / 72
    anchors, boxes = [], []
    for c in curve:
        if c["beta"] not in CURVE_LABEL_BETAS:
            continue
        xy = (c[xkey], c["reward"])
        fx, fy = to_axes.transform(xy)
        px, py = ax.transData.transform(xy)
        if not (0 <= fx <= 1 and 0 <= fy <= 1) or any(math.hypot(px - qx, py - qy) < sep for qx, qy in anchors):
            continue
        side = -1 if fx > 0.8 else 1
        for dy in (-8, 4):
            t = ax.annotate(
                f"β={c['beta']:g}",
                xy,
                xytext=(3 * side, dy),
                textcoords="offset points",
                fontsize=6,
                ha="left" if side > 0 else "right",
            )
            box = t.get_window_extent(renderer)
            if not any(box.overlaps(b) for b in boxes):
                anchors.append((px, py))
                boxes.append(box)
                break
            t.remove()


def sweep_figures(
    rows: Sequence[Mapping[str, Any]],
    curve: Sequence[Mapping[str, float]] | None,
    labels: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The figures of :func:`plot_sweep` by file stem (``reward_vs_kl``, ``reward_vs_diversity``); the caller closes
    them.

    A run keeps its colour (and marker, past the palette's length) in every panel; its legend entry is
    its label from ``labels`` (``kl.coef=0.05``; default its name). Points use the exact columns when a
    run has them (filled), else the sampled tail means (hollow); the axis label says which of the two
    kinds its panel shows. Legends sit right of the axes.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = labels or {}
    cmap = plt.get_cmap("tab10" if len(rows) <= 10 else "tab20")
    markers = "osD^v"

    def finite(x: Any, y: Any) -> bool:
        return isinstance(x, float) and isinstance(y, float) and math.isfinite(x) and math.isfinite(y)

    def scatter(ax, xkey: str, ykey: str, xfb: str | None, yfb: str) -> set[bool]:
        """One point per row with values; returns which kinds were drawn (True: exact, False: sampled)."""
        kinds = set()
        for i, r in enumerate(rows):
            x, y = r.get(xkey, float("nan")), r.get(ykey, float("nan"))
            exact = finite(x, y)
            if not exact and xfb is not None:
                x, y = r.get(xfb, float("nan")), r.get(yfb, float("nan"))
            if finite(x, y):
                c = cmap(i % cmap.N)
                m = markers[(i // cmap.N) % len(markers)]
                ax.scatter(
                    [x],
                    [y],
                    color=c if exact else "none",
                    edgecolors=c,
                    marker=m,
                    s=36,
                    zorder=3,
                    label=labels.get(r["name"], r["name"]),
                )
                kinds.add(exact)
        return kinds

    def kind_note(kinds: set[bool]) -> str:
        return {
            frozenset({True}): " (exact)",
            frozenset({False}): " (hollow: sampled)",
            frozenset({True, False}): " (filled: exact; hollow: sampled)",
        }.get(frozenset(kinds), "")

    def draw_curve(ax, xkey: str) -> None:
        if curve:
            ax.plot(
                [c[xkey] for c in curve],
                [c["reward"] for c in curve],
                "k-",
                lw=1.2,
                zorder=2,
                label="exact optimum π*_β",
            )

    def legend(ax, axes) -> None:
        """One legend right of ``ax`` for the curve and the runs drawn on any of ``axes``, in the rows' order."""
        handles: dict[str, Any] = {}
        for a in axes:
            for h, lab in zip(*a.get_legend_handles_labels(), strict=True):
                handles.setdefault(lab, h)
        order = {labels.get(r["name"], r["name"]): i for i, r in enumerate(rows)}
        handles = dict(sorted(handles.items(), key=lambda kv: order.get(kv[0], -1)))
        if handles:
            ax.legend(
                handles.values(),
                handles.keys(),
                fontsize=6,
                loc="upper left",
                bbox_to_anchor=(1.01, 1),
                ncol=1 if len(handles) <= 30 else 2,
            )

    figs = {}
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    draw_curve(ax, "kl_tok")
    kinds = scatter(ax, "exact_kl_tok", "exact_score", "kl_tok", "reward")
    ax.set_xlabel("KL(π‖π_ref), nats per token" + kind_note(kinds))
    ax.set_ylabel("expected reward")
    ax.set_title("reward against KL")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    legend(ax, [ax])
    if curve:
        _label_curve(ax, curve, "kl_tok")
    figs["reward_vs_kl"] = fig

    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
    draw_curve(axes[0], "correct_effective_answers")
    kinds = scatter(axes[0], "correct_eff_answers", "exact_score", None, "reward")
    axes[0].set_xlabel("distinct correct answers, exp H(π | correct)" + kind_note(kinds))
    draw_curve(axes[1], "unique_frac")
    kinds = scatter(axes[1], "exact_unique_frac", "exact_score", "unique_frac", "reward")
    axes[1].set_xlabel("unique fraction among n samples" + kind_note(kinds))
    for a in axes:
        a.set_ylabel("expected reward")
        a.grid(alpha=0.3)
    fig.suptitle("reward against diversity")
    fig.tight_layout()
    legend(axes[1], list(axes))
    if curve:
        _label_curve(axes[0], curve, "correct_effective_answers")
        _label_curve(axes[1], curve, "unique_frac")
    figs["reward_vs_diversity"] = fig
    return figs


def plot_sweep(
    rows: Sequence[Mapping[str, Any]],
    curve: Sequence[Mapping[str, float]] | None,
    out: Path,
    labels: Mapping[str, str] | None = None,
) -> list[Path]:
    """``reward_vs_kl.png`` and ``reward_vs_diversity.png`` (:func:`sweep_figures`): one point per run, and the
    optimum's curve.

    Returns the written paths.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    paths = []
    for name, fig in sweep_figures(rows, curve, labels).items():
        fig.savefig(out / f"{name}.png", dpi=100, bbox_inches="tight")
        plt.close(fig)
        paths.append(out / f"{name}.png")
    return paths


def summarize_sweep(
    out: Path,
    runs: Sequence[RunSpec],
    *,
    tail: int = 20,
    exact_final: str = "all",
    threads: int = 1,
    plots: bool = True,
    echo=print,
) -> list[dict[str, Any]]:
    """Exact final evaluations (``exact_final`` ≠ ``none``), ``table.csv``/``table.md`` and the plots.

    Returns the table rows.
    """
    out = Path(out)
    ref_cache: dict = {}
    rows = []
    temps = set()
    if exact_final != "none":
        import torch

        torch.set_num_threads(max(1, threads))
    for run in runs:
        run_dir = out / run.name
        exact = None
        if exact_final != "none" and (run_dir / DONE_MARKER).is_file():
            exact = evaluate_final(run_dir, exact_final, ref_cache)
            if exact is not None:
                exact = dict(exact) | {"_prompts": exact_final}
        rows.append(summarize_run(run_dir, run, tail=tail, exact=exact))
        temps.add(float(_read_yaml(run_dir / "config.yaml").get("rollout", {}).get("temperature", 1.0)))
    varying = list(dict.fromkeys(k for r in runs for k, _ in r.overrides))
    csv_path, md_path = write_table(rows, out, varying)
    echo(f"table: {md_path}")
    if plots:
        curve = None
        sources = {r.get("exact_source") for r in rows if r.get("exact_source")}
        which = exact_final if exact_final != "none" and sources != {"val (log)"} else "val"
        if len(temps) <= 1:
            n = int(_read_yaml(out / runs[0].name / "config.yaml").get("rollout", {}).get("n", 8)) if runs else 8
            curve = optimum_curve(
                exact_prompts(which),
                CURVE_BETAS,
                temperature=temps.pop() if temps else 1.0,
                n_samples=n,
                ref_cache=ref_cache,
            )
            (out / "optimum_curve.json").write_text(json.dumps({"prompts": which, "curve": curve}, indent=1))
        for p in plot_sweep(rows, curve, out, labels=plot_labels(runs)):
            echo(f"plot: {p}")
    return rows


def main_sweep(
    spec_path: str | None,
    grid: Sequence[str],
    fixed: Sequence[str],
    *,
    out: str | None = None,
    workers: int | None = None,
    tail: int | None = None,
    exact_final: str | None = None,
    dry_run: bool = False,
    table_only: bool = False,
) -> int:
    """Entry point of ``tether sweep``: 0 when every run finished, 1 when some failed, 2 on a bad spec."""
    try:
        spec = load_spec(
            spec_path, grid=grid, fixed=fixed, out=out, workers=workers, tail=tail, exact_final=exact_final
        )
        if problem := output_problem(spec.out, "dir", "the sweep's out"):
            raise SweepError(problem)
        runs = spec.runs()
        for run in runs:  # validate every config before starting anything
            try:
                load_config(None, run.args())
            except ConfigError as e:
                raise SweepError(f"run {run.name}: {e}") from None
    except SweepError as e:
        print(f"tether sweep: {e}", file=sys.stderr)
        return 2
    if table_only:
        summarize_sweep(Path(spec.out), runs, tail=spec.tail, exact_final=spec.exact_final)
        return 0
    results = run_sweep(spec, workers=workers, dry_run=dry_run)
    failed = [r for r in results if r.status == "failed"]
    for r in failed:
        print(f"tether sweep: {r.run.name} failed (exit {r.rc}); log: {r.run_dir / 'train.log'}", file=sys.stderr)
    return 1 if failed else 0
