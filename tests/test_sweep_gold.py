"""tether sweep's table: val_gold and val_gold_gap (the last val/gold_mean and val/gold_gap, issue 23 item 1)."""

from __future__ import annotations

import csv
import json
import math

from tether import sweep as sw


def _run(d, gold: bool):
    d.mkdir(parents=True)
    with (d / "metrics.jsonl").open("w") as f:
        for step, score in ((0, 0.5), (10, 0.8), (20, 0.9)):
            rec = {"step": step, "reward/score_mean": score, "val/score_mean": score}
            if gold:
                rec |= {"val/gold_mean": score - step / 100, "val/gold_gap": step / 100}
            f.write(json.dumps(rec) + "\n")
        f.write(json.dumps({"step": 21, "reward/score_mean": 0.95}) + "\n")  # a step without validation


def test_the_table_gets_the_last_gold_and_gap(tmp_path):
    _run(tmp_path / "a", gold=True)
    _run(tmp_path / "b", gold=False)
    a, b = sw.summarize_run(tmp_path / "a"), sw.summarize_run(tmp_path / "b")
    assert a["val_score"] == 0.9 and a["val_gold"] == 0.7 and a["val_gold_gap"] == 0.2
    assert math.isnan(b["val_gold"]) and math.isnan(b["val_gold_gap"])
    sw.write_table([a, b], tmp_path / "out")
    with (tmp_path / "out" / "table.csv").open() as f:
        table = list(csv.DictReader(f))
    assert (
        float(table[0]["val_gold"]) == 0.7 and float(table[0]["val_gold_gap"]) == 0.2 and table[1]["val_gold"] == "nan"
    )
    md = (tmp_path / "out" / "table.md").read_text().splitlines()
    assert md[0].endswith("| val score | val gold | val gap (score − gold) |")
    assert md[2].endswith("| 0.900 | 0.700 | 0.200 |") and md[3].endswith("| 0.900 | – | – |")
    sw.write_table([b], tmp_path / "nogold")  # no run with a gold: the markdown table is as before
    assert "val gold" not in (tmp_path / "nogold" / "table.md").read_text()
