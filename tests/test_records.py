"""trainer.log_rollouts: token-level rollout records, reproducible, bounded, atomic, and kept once across resume."""

import math

import pyarrow.parquet as pq
import pytest
import torch

from tether import records as rec_mod
from tether.config import load_config
from tether.outputs import OutputWriteError
from tether.records import (
    SCHEMA,
    RolloutRecorder,
    choose_rows,
    read_records,
    record_files,
    record_path,
)
from tether.trainer import Trainer

BASE = [
    "trainer.progress=false",
    "trainer.threads=1",
    "trainer.report=false",
    "trainer.loggers=[jsonl]",
    "trainer.seed=5",
    "trainer.total_steps=4",
    "trainer.save_freq=2",
    "trainer.val_freq=0",
    "data.batch_size=4",
    "data.embedded_train_size=8",
    "rollout.n=2",
    "algo.mini_batch_size=8",
    "trainer.log_rollouts=1",
    "trainer.log_rollouts_k=3",
]


def cfg(out, *extra):
    return load_config(None, [*BASE, f"trainer.output_dir={out}", *extra])


def test_choose_rows_is_reproducible_distinct_and_takes_all_when_k_covers_the_batch():
    a = choose_rows(16, 5, seed=1, step=7)
    assert a == choose_rows(16, 5, seed=1, step=7) and a == sorted(set(a)) and len(a) == 5
    assert all(0 <= i < 16 for i in a)
    others = {tuple(choose_rows(16, 5, seed=1, step=s)) for s in range(1, 9)}
    assert len(others) > 1  # the rows change with the step
    assert choose_rows(3, 5, seed=1, step=7) == [0, 1, 2]


@pytest.mark.slow
def test_a_run_records_each_due_step_with_the_batchs_own_numbers(tmp_path):
    out = tmp_path / "run"
    trainer = Trainer(cfg(out, "trainer.log_rollouts=2", "kl.estimator=k1"))
    seen = {}
    maybe = trainer.records.maybe_record

    def spy(step, batch, val_samples=None):
        seen[step] = batch
        return maybe(step, batch, val_samples)

    trainer.records.maybe_record = spy
    trainer.fit()
    assert [s for s, _ in record_files(out)] == [2, 4]
    table, problems = read_records(out)
    assert problems == [] and table.schema == SCHEMA and table.num_rows == 6
    for row in table.to_pylist():
        batch, i = seen[row["step"]], row["index"]
        n = int(batch.response_mask[i].sum())
        assert len(row["response_ids"]) == n and row["response_ids"] == batch.response_ids[i, :n].tolist()
        assert row["response"] == batch.responses[i] and row["group_id"] == int(batch.group_ids[i])
        assert row["data_source"] == batch.rows[i].data_source
        assert row["reward"] == pytest.approx(float(batch.scores[i]), abs=0)
        lp, ref, kl = (torch.tensor(row[k]) for k in ("logprobs", "ref_logprobs", "kl"))
        # k1: the recorded KL term is the recorded log-ratio (float32 on both sides: one rounding of the difference)
        torch.testing.assert_close(kl, lp - ref, atol=1e-6, rtol=0)
        torch.testing.assert_close(torch.tensor(row["advantages"]), batch.advantages[i, :n].float(), atol=0, rtol=0)
        assert row["loss_mask"] == batch.update_mask[i, :n].tolist() and set(row["response_mask"]) == {1}
        assert row["finish_reason"] in ("eos", "length") and row["truncated"] == (row["finish_reason"] == "length")
    metrics = [line for line in (out / "metrics.jsonl").read_text().splitlines() if '"records/written"' in line]
    assert len(metrics) == 2  # records/written on the recorded steps only


class Crash(Exception):
    pass


@pytest.mark.slow
def test_resume_records_each_step_once_and_as_the_uninterrupted_run(tmp_path):
    whole = tmp_path / "whole"
    Trainer(cfg(whole)).fit()
    want = {s: pq.read_table(p).to_pylist() for s, p in record_files(whole)}
    assert sorted(want) == [1, 2, 3, 4]

    cut = tmp_path / "cut"
    first = Trainer(cfg(cut))
    step = first.train_step

    def train_step():  # dies after step 3 was recorded: its checkpoint is step 2's
        if first.step >= 3:
            raise Crash
        return step()

    first.train_step = train_step
    with pytest.raises(Crash):
        first.fit()
    assert [s for s, _ in record_files(cut)] == [1, 2, 3]
    Trainer(cfg(cut)).fit()  # resumes at step 2: step 3's file goes, steps 3 and 4 are recorded again
    got = {s: pq.read_table(p).to_pylist() for s, p in record_files(cut)}
    assert sorted(got) == [1, 2, 3, 4]
    for s in want:
        assert got[s] == want[s], s


def test_recorder_deletes_later_steps_on_resume_and_prunes_the_oldest_first(tmp_path):
    d = tmp_path / "rollouts"
    d.mkdir()
    for s in (1, 2, 3, 4):
        (d / f"step_{s:07d}.parquet").write_bytes(b"x" * 1000)
    (d / "notes.txt").write_text("kept")
    r = RolloutRecorder(tmp_path, every=1, k=2, max_mb=2500 / 2**20, seed=0, resume_step=2)
    assert [s for s, _ in record_files(tmp_path)] == [1, 2] and (d / "notes.txt").exists()
    for s in (3, 4, 5):
        (d / f"step_{s:07d}.parquet").write_bytes(b"x" * 1000)
    removed = r.prune()  # 5000 bytes in 5 files, bound 2500: the three oldest go
    assert [p.name for p in removed] == [f"step_{s:07d}.parquet" for s in (1, 2, 3)]
    assert [s for s, _ in record_files(tmp_path)] == [4, 5]
    tiny = RolloutRecorder(tmp_path, every=1, k=2, max_mb=1 / 2**20, seed=0, resume_step=10)
    tiny.prune()
    assert [s for s, _ in record_files(tmp_path)] == [5]  # the newest file always stays


def test_a_failed_write_is_counted_and_the_run_goes_on(tmp_path, monkeypatch):
    from tether.batch import RolloutBatch
    from tether.data import PromptRow

    batch = RolloutBatch(
        prompt_ids=torch.ones(2, 2, dtype=torch.long),
        prompt_mask=torch.ones(2, 2, dtype=torch.long),
        response_ids=torch.tensor([[5, 6, 0], [7, 0, 0]]),
        response_mask=torch.tensor([[1, 1, 0], [1, 0, 0]]),
        group_ids=torch.tensor([0, 0]),
        rows=[PromptRow("p", "src", None, {}, 0)] * 2,
        prompts=["p", "p"],
        responses=["ab", "c"],
        scores=torch.tensor([1.0, 0.0]),
    )
    r = RolloutRecorder(tmp_path, every=1, k=8, max_mb=1, seed=0)
    assert r.maybe_record(1, batch) == {"records/written": 2.0}
    row = pq.read_table(record_path(tmp_path, 1)).to_pylist()[1]
    assert row["response_ids"] == [7] and row["logprobs"] == [] and row["loss_mask"] == [1]
    assert row["finish_reason"] == "" and math.isclose(row["reward"], 0.0)

    def full_disk(*a, **k):
        raise OutputWriteError(28, record_path(tmp_path, 2), "No space left on device")

    monkeypatch.setattr(rec_mod, "atomic_output", full_disk)
    assert r.maybe_record(2, batch) == {"records/failed": 1.0}
    assert [s for s, _ in record_files(tmp_path)] == [1]
    monkeypatch.undo()
    assert r.maybe_record(3, batch) == {"records/written": 2.0}  # the next due step writes again


def test_read_records_skips_and_names_a_corrupt_file(tmp_path):
    assert read_records(tmp_path) == (None, [])
    d = tmp_path / "rollouts"
    d.mkdir()
    (d / "step_0000003.parquet").write_bytes(b"PAR1 not really")
    table, problems = read_records(tmp_path)
    assert table is None and len(problems) == 1 and "step_0000003.parquet" in problems[0]


@pytest.mark.slow
def test_every_validation_sample_is_recorded_with_its_reward(tmp_path):
    """val_freq 2, val_n 2 on 2 prompts: 4 "val" rows at steps 0 (a file of its own, before training), 2 and 4; their
    mean reward is the logged val/score_mean (every sample scored here), and they carry no per-token numbers."""
    import json

    out = tmp_path / "run"
    Trainer(
        cfg(out, "trainer.val_freq=2", "trainer.val_n=2", "data.embedded_val_size=2", "trainer.log_rollouts=2")
    ).fit()
    assert [s for s, _ in record_files(out)] == [0, 2, 4]
    logged = {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}
    for step, path in record_files(out):
        rows = pq.read_table(path).to_pylist()
        val = [r for r in rows if r["kind"] == "val"]
        assert len(val) == 4 and len(rows) == 4 + (3 if step else 0)
        assert sum(r["reward"] for r in val) / 4 == pytest.approx(logged[step]["val/score_mean"], abs=1e-12)
        assert logged[step]["records/written"] == len(rows)
        for r in val:
            assert r["kl"] == [] and r["gold"] is None and len(r["tokens"]) == len(r["response_ids"]) > 0
            assert r["finish_reason"] == ("length" if r["truncated"] else "eos")


@pytest.mark.slow
def test_a_few_recorded_responses_reach_tensorboard_as_text(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tether.records import SAMPLES_LOGGED

    out = tmp_path / "run"
    Trainer(cfg(out, "trainer.loggers=[jsonl,tensorboard]", "trainer.total_steps=2")).fit()
    acc = EventAccumulator(str(out / "events"), size_guidance={"tensors": 0}).Reload()
    events = acc.Tensors("rollouts/text_summary")
    assert [e.step for e in events] == [1, 2]
    rows = pq.read_table(record_path(out, 2)).to_pylist()[:SAMPLES_LOGGED]
    text = events[1].tensor_proto.string_val[0].decode()
    lines = text.splitlines()
    assert lines[0] == "| kind | data_source | reward | gold | kl_mean | prompt | response |"
    assert len(lines) == 2 + len(rows)
    for line, r in zip(lines[2:], rows, strict=True):
        assert line.startswith(f"| train | {r['data_source']} | {r['reward']:.4g} | – |") and r["prompt"] in line


def test_the_recorded_rows_reach_a_wandb_table(tmp_path, monkeypatch):
    """W&B is not installed in CI: a stand-in module records what MetricsLogger hands it (the table's columns and
    rows, and the step)."""
    import sys
    import types

    from tether.trainer.logging import MetricsLogger

    logged = []

    class Table:
        def __init__(self, columns, data):
            self.columns, self.data = columns, data

    class Run:
        def log(self, values, step=None):
            logged.append((step, values))

        def finish(self):
            pass

    fake = types.SimpleNamespace(init=lambda **kw: Run(), Table=Table)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    logger = MetricsLogger(tmp_path, ["jsonl", "wandb"], config={}, project="p")
    row = {"kind": "val", "data_source": "s", "reward": 1.0, "gold": 0.0, "kl": [], "prompt": "3,4=", "response": "7"}
    logger.log_samples(5, [row, {**row, "kind": "train", "gold": None, "kl": [0.5, -0.25]}])
    logger.close()
    ((step, values),) = logged
    table = values["rollouts"]
    assert step == 5 and table.columns == ["kind", "data_source", "reward", "gold", "kl_mean", "prompt", "response"]
    assert table.data == [["val", "s", 1.0, 0.0, None, "3,4=", "7"], ["train", "s", 1.0, None, 0.125, "3,4=", "7"]]
