"""Rollout records: token-level Parquet files of what the policy wrote (``trainer.log_rollouts``).

Every ``trainer.log_rollouts`` steps, ``trainer.log_rollouts_k`` responses of the step's batch, chosen
reproducibly (a generator seeded by ``(trainer.seed, step)``), and every sample of every validation (step 0's
included) are written to
``RUN_DIR/rollouts/step_XXXXXXX.parquet``, one row per response. Each file is written whole or not at all
(:func:`tether.outputs.atomic_output`); the directory is kept under ``trainer.log_rollouts_max_mb`` by
deleting the oldest steps' files first; on resume from step S the files of steps after S are deleted, since
those steps run again (each step is recorded once, as metrics.jsonl keeps each step's line once).

Columns (one row per response; per-token columns are lists of the response's T tokens, padding cut off):

==================  =====================================================================================
step, kind          the training step; ``"train"``, or ``"val"`` for a validation sample (every one is recorded)
index, group_id     the response's row in the step's batch and the prompt group it answers (validation: its
                    place in the validation and its prompt's dataset index)
data_source         the dataset row's ``data_source``; ``prompt``, ``response``: decoded text
response_ids        int32 token ids the engine sampled; ``tokens``: each decoded alone (the viewer's text)
logprobs            float32 log π_old(a_t|s_t), nats (the policy that sampled, as the trainer computed it)
ref_logprobs        float32 log π_ref(a_t|s_t), nats
kl                  float32 the KL estimator's per-token term (``kl.estimator``), nats
entropy             float32 entropy of π_old at each position, nats (empty where not computed)
advantages          float32 per-token advantage
rollout_logprobs    float32 the engine's own log-probs (NaN where unknown; empty without one)
is_weights          float32 rollout-correction weights (empty without ``algo.rollout_correction``)
response_mask       int8, 1 = the token counts; ``generated_mask`` 1 = the model wrote it;
loss_mask           int8, 1 = the actor trained on it (``RolloutBatch.update_mask``)
reward              float64 the sequence score; null for a sample not scored
gold                float64 the gold reward where one scored the response; null otherwise (training steps)
finish_reason       ``eos`` | ``length`` | ``stop`` | ``abort`` | ``""`` (unknown); ``truncated`` bool
==================  =====================================================================================

Tensor names and units follow :class:`tether.batch.RolloutBatch`.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from tether.algos import last_valid_index
from tether.batch import RolloutBatch
from tether.outputs import OutputWriteError, atomic_output

log = logging.getLogger("tether")

RECORDS_DIR = "rollouts"
#: rows of each written file also logged to TensorBoard (text) and W&B (a table)
SAMPLES_LOGGED = 4
_NAME = re.compile(r"^step_(\d{7,})\.parquet$")

_TOKEN_FLOAT_FIELDS = ("logprobs", "ref_logprobs", "kl", "entropy", "advantages", "rollout_logprobs", "is_weights")
_TOKEN_MASK_FIELDS = ("response_mask", "generated_mask", "loss_mask")

SCHEMA = pa.schema(
    [
        ("step", pa.int64()),
        ("kind", pa.string()),
        ("index", pa.int32()),
        ("group_id", pa.int64()),
        ("data_source", pa.string()),
        ("prompt", pa.string()),
        ("response", pa.string()),
        ("response_ids", pa.list_(pa.int32())),
        ("tokens", pa.list_(pa.string())),
        *[(name, pa.list_(pa.float32())) for name in _TOKEN_FLOAT_FIELDS],
        *[(name, pa.list_(pa.int8())) for name in _TOKEN_MASK_FIELDS],
        ("reward", pa.float64()),
        ("gold", pa.float64()),
        ("finish_reason", pa.string()),
        ("truncated", pa.bool_()),
    ]
)


def record_path(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / RECORDS_DIR / f"step_{step:07d}.parquet"


def record_files(run_dir: str | Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of every record file of the run, by step; other files (temporaries) are ignored."""
    d = Path(run_dir) / RECORDS_DIR
    if not d.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in d.iterdir() if (m := _NAME.match(p.name))]
    return sorted(found)


def choose_rows(n: int, k: int, seed: int, step: int) -> list[int]:
    """``min(k, n)`` distinct batch rows, sorted, drawn by a generator seeded by ``(seed, step)``: the same rows
    whenever the step is recorded (a resumed run records what the uninterrupted one did)."""
    if k >= n:
        return list(range(n))
    g = torch.Generator().manual_seed((seed * 1_000_003 + step) % (2**63))
    return sorted(torch.randperm(n, generator=g)[:k].tolist())


def batch_records(
    batch: RolloutBatch, step: int, rows: list[int], token_text: Callable[[list[int]], list[str]] | None = None
) -> pa.Table:
    """The chosen ``rows`` of ``batch`` as a table of :data:`SCHEMA` (see the module docstring); ``token_text``
    turns a response's ids into one string per token (default: the ids as text)."""
    written = batch.response_mask.bool()
    if batch.generated_mask is not None:  # a dropped sample's row of response_mask is all 0; what it wrote is not
        written = written | batch.generated_mask.bool()
    lengths = (last_valid_index(written) + 1).tolist()  # each row up to its last marked token; 0 for none
    update = batch.update_mask
    masks = {
        "response_mask": batch.response_mask,
        "generated_mask": batch.generated_mask if batch.generated_mask is not None else batch.response_mask,
        "loss_mask": update,
    }
    cols: dict[str, list] = {name: [] for name in SCHEMA.names}
    for i in rows:
        n = lengths[i]
        row = batch.rows[i]
        cols["step"].append(step)
        cols["kind"].append("train")
        cols["index"].append(i)
        cols["group_id"].append(int(batch.group_ids[i]))
        cols["data_source"].append(str(row.data_source))
        cols["prompt"].append(batch.prompts[i])
        cols["response"].append(batch.responses[i])
        ids = batch.response_ids[i, :n].tolist()
        cols["response_ids"].append(ids)
        cols["tokens"].append(token_text(ids) if token_text is not None else [str(x) for x in ids])
        for name in _TOKEN_FLOAT_FIELDS:
            t = getattr(batch, _FIELD.get(name, name))
            cols[name].append([] if t is None else t[i, :n].detach().float().cpu().tolist())
        for name, t in masks.items():
            cols[name].append(t[i, :n].to(torch.int8).cpu().tolist())
        score = float(batch.scores[i]) if batch.scores is not None else math.nan
        cols["reward"].append(score if math.isfinite(score) else None)
        cols["gold"].append(None)
        cols["finish_reason"].append(batch.finish_reasons[i] if batch.finish_reasons is not None else "")
        cols["truncated"].append(bool(batch.truncated[i]) if batch.truncated is not None else False)
    return pa.table(cols, schema=SCHEMA)


def val_records(samples: list[dict], step: int, token_text: Callable[[list[int]], list[str]] | None = None) -> pa.Table:
    """Validation samples (records of :func:`tether.evaluation.sampled.evaluate_prompts`) as rows of
    :data:`SCHEMA`, ``kind="val"``: text, token ids, reward (null where the reward could not score it) and gold
    (null where no gold scored it); no per-token numbers (validation computes none). ``index`` is the
    sample's place in the validation, ``group_id`` its prompt's dataset index."""
    cols: dict[str, list] = {name: [] for name in SCHEMA.names}
    for j, r in enumerate(samples):
        ids = list(r.get("response_ids", []))
        cols["step"].append(step)
        cols["kind"].append("val")
        cols["index"].append(j)
        cols["group_id"].append(int(r.get("index", -1)))
        cols["data_source"].append(str(r.get("data_source", "")))
        cols["prompt"].append(r.get("prompt", ""))
        cols["response"].append(r.get("response", ""))
        cols["response_ids"].append(ids)
        cols["tokens"].append(token_text(ids) if token_text is not None else [str(x) for x in ids])
        for name in (*_TOKEN_FLOAT_FIELDS, *_TOKEN_MASK_FIELDS):
            cols[name].append([])
        cols["reward"].append(float(r["score"]) if r.get("scored", True) and "score" in r else None)
        gold = r.get("gold") if r.get("gold_scored", False) else None
        cols["gold"].append(float(gold) if gold is not None else None)
        truncated = bool(r.get("truncated", False))
        cols["finish_reason"].append("length" if truncated else "eos")
        cols["truncated"].append(truncated)
    return pa.table(cols, schema=SCHEMA)


_FIELD = {"logprobs": "old_logprobs"}  # record column -> RolloutBatch field, where they differ


class RolloutRecorder:
    """Writes a step's records (``trainer.log_rollouts``); see the module docstring.

    Args:
        run_dir: the run directory; files go to ``run_dir/rollouts/``.
        every: record every N steps (0 = never: :meth:`maybe_record` does nothing).
        k: responses per recorded step.
        max_mb: the directory's size bound, MiB; the oldest steps' files are deleted first.
        seed: ``trainer.seed`` (with the step, it chooses the rows).
        resume_step: the step the run continues from; files of later steps are deleted.
        token_text: a response's ids -> one string per token (the tokenizer's decode of each id alone).
    """

    def __init__(
        self,
        run_dir: Path,
        *,
        every: int,
        k: int,
        max_mb: float,
        seed: int,
        resume_step: int = 0,
        token_text: Callable[[list[int]], list[str]] | None = None,
    ):
        self.run_dir, self.every, self.k, self.max_bytes, self.seed = Path(run_dir), every, k, max_mb * 2**20, seed
        self.token_text = token_text
        self.last_rows: list[dict] = []  # a few rows of the last file written, for TensorBoard and W&B
        self.failed = 0
        for step, path in record_files(self.run_dir):
            if step > resume_step:
                path.unlink(missing_ok=True)

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def maybe_record(
        self, step: int, batch: RolloutBatch | None, val_samples: list[dict] | None = None
    ) -> dict[str, float]:
        """Write step ``step``'s file: ``trainer.log_rollouts_k`` responses of ``batch`` if the step is due, and
        every validation sample of ``val_samples`` (records of :func:`tether.evaluation.sampled.evaluate_prompts`);
        returns ``{"records/written": rows}``, or nothing when there was nothing to write. A write that fails (full
        disk, no permission) is logged, counted in ``records/failed`` and skipped: records never stop a run."""
        parts = []
        if batch is not None and self.due(step) and len(batch):
            parts.append(batch_records(batch, step, choose_rows(len(batch), self.k, self.seed, step), self.token_text))
        if val_samples:
            parts.append(val_records(val_samples, step, self.token_text))
        if not parts:
            return {}
        table = pa.concat_tables(parts)
        path = record_path(self.run_dir, step)
        try:
            with atomic_output(path, "file") as tmp:
                pq.write_table(table, tmp, compression="zstd")
        except OutputWriteError as e:
            self.failed += 1
            log.warning("rollout records of step %d not written (%s); training goes on", step, e)
            return {"records/failed": float(self.failed)}
        self.prune()
        self.last_rows = table.slice(0, SAMPLES_LOGGED).to_pylist()
        return {"records/written": float(table.num_rows)}

    def prune(self) -> list[Path]:
        """Delete the oldest record files until the directory is within ``max_mb`` (the newest file always stays)."""
        files = record_files(self.run_dir)
        sizes = [p.stat().st_size for _, p in files]
        total, removed = sum(sizes), []
        for (_, path), size in zip(files[:-1], sizes[:-1], strict=True):
            if total <= self.max_bytes:
                break
            path.unlink(missing_ok=True)
            total -= size
            removed.append(path)
        return removed


def read_records(run_dir: str | Path) -> tuple[pa.Table | None, list[str]]:
    """Every complete record file of a run as one table, and a line per file that could not be read (a corrupt
    or truncated file is skipped and named). ``(None, [])`` when the run has none."""
    tables, problems = [], []
    for _, path in record_files(run_dir):
        try:
            tables.append(pq.read_table(path, schema=SCHEMA))
        except (OSError, pa.ArrowException, ValueError) as e:
            problems.append(f"{path}: not a readable record file ({str(e).splitlines()[0][:200]}); skipped")
    if not tables:
        return None, problems
    return pa.concat_tables(tables), problems
