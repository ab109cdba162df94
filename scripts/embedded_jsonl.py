"""Write the embedded task's train and val rows as JSONL files: the same prompts as ``data.train_files=embedded``, read
as a user's dataset, so the run has no ``exact/*`` evaluation (it applies to the embedded data only) and a gold reward
(``reward.val_function``) is the sampled one alone (docs/hacking.md: the guard with a sampled gold).

Usage: python scripts/embedded_jsonl.py OUT_DIR [--task digitsum] [--seed 0] [--train 2000] [--val 32]
Then: tether train data.train_files=OUT_DIR/train.jsonl data.val_files=OUT_DIR/val.jsonl ...
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tether.tasks import embedded_task


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=Path(__file__).name, description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("out", type=Path, help="the directory for train.jsonl and val.jsonl")
    ap.add_argument("--task", default="digitsum", help="data.embedded_task (default digitsum)")
    ap.add_argument("--seed", type=int, default=0, help="trainer.seed the rows are drawn with (default 0)")
    ap.add_argument("--train", type=int, default=2000, help="data.embedded_train_size (default 2000)")
    ap.add_argument("--val", type=int, default=32, help="data.embedded_val_size (default 32)")
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    task = embedded_task(a.task)
    for split, n in (("train", a.train), ("val", a.val)):
        rows = task.make_dataset(split, n, seed=a.seed)
        (a.out / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"{a.out / f'{split}.jsonl'}: {len(rows)} rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
