"""How fast ``tether view`` shows the first page of a large run: 100k recorded responses by default.

    python benchmarks/bench_viewer.py [--responses 100000] [--tokens 64] [--steps 1000] [--repeats 3]

Writes a synthetic run directory (``--steps`` record files of ``responses / steps`` responses of ``--tokens``
tokens each, random per-token numbers, and a metrics.jsonl line per step), then, ``--repeats`` times in this
process:

* ``load``: :func:`tether.viewer.load_run` + :func:`tether.viewer.summary` (what the server does on its first
  ``/api/summary``): seconds, and the summary's JSON size;
* ``page``: a fresh headless Chromium page (the OS's Chromium, as the tests use) on a fresh server: seconds from
  ``goto`` until the first 20 samples are drawn (``body[data-ready]``), the server's first read included.

Prints the medians. Needs playwright and Chromium (``make install-browser``).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "viewer"))

from conftest import chromium_path  # noqa: E402

from tether.records import SCHEMA, record_path  # noqa: E402
from tether.viewer import load_run, make_server, summary  # noqa: E402
from tether.viewer.data import to_json  # noqa: E402


def synthetic_run(root: Path, responses: int, tokens: int, steps: int, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    per = responses // steps
    vocab = [f"t{i}" for i in range(500)]
    lines = []
    for step in range(1, steps + 1):
        ids = rng.integers(0, 500, size=(per, tokens))
        floats = {c: rng.normal(size=(per, tokens)).astype(np.float32) for c in SCHEMA.names if _is_float_list(c)}
        cols = {
            "step": [step] * per,
            "kind": ["train"] * per,
            "index": list(range(per)),
            "group_id": [i // 4 for i in range(per)],
            "data_source": ["synthetic"] * per,
            "prompt": [f"prompt {(step * per + i) % 5000}" for i in range(per)],
            "response": [" ".join(vocab[j] for j in row) for row in ids],
            "response_ids": ids.astype(np.int32).tolist(),
            "tokens": [[vocab[j] for j in row] for row in ids],
            **{c: v.tolist() for c, v in floats.items()},
            "response_mask": np.ones((per, tokens), np.int8).tolist(),
            "generated_mask": np.ones((per, tokens), np.int8).tolist(),
            "loss_mask": np.ones((per, tokens), np.int8).tolist(),
            "reward": rng.random(per).tolist(),
            "gold": [float("nan")] * per,
            "finish_reason": ["eos"] * per,
            "truncated": [False] * per,
        }
        path = record_path(root, step)
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table(cols, schema=SCHEMA), path, compression="zstd")
        lines.append(f'{{"step": {step}, "reward/score_mean": {rng.random():.4f}, "kl/ref_mean": {step * 1e-4:.6f}}}')
    (root / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return root


def _is_float_list(name: str) -> bool:
    t = SCHEMA.field(name).type
    return pa.types.is_list(t) and pa.types.is_floating(t.value_type)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--responses", type=int, default=100_000)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    from playwright.sync_api import sync_playwright

    tmp = Path(tempfile.mkdtemp(prefix="bench_viewer_"))
    try:
        t0 = time.perf_counter()
        run = synthetic_run(tmp / "run", args.responses, args.tokens, args.steps)
        size = sum(p.stat().st_size for p in (run / "rollouts").iterdir())
        print(
            f"wrote {args.responses} responses x {args.tokens} tokens in {args.steps} files ({size / 2**20:.1f} MiB)"
            f" in {time.perf_counter() - t0:.1f} s"
        )
        loads, pages = [], []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            body = to_json(summary(load_run(run)))
            loads.append(time.perf_counter() - t0)
        print(
            f"load: median {statistics.median(loads):.2f} s over {args.repeats}; "
            f"summary JSON {len(body) / 2**20:.1f} MiB"
        )
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium_path(), args=["--no-sandbox"])
            for _ in range(args.repeats):
                server = make_server(run, port=0)  # its own first read is outside the timed page load
                threading.Thread(target=server.serve_forever, daemon=True).start()
                page = browser.new_page()
                t0 = time.perf_counter()
                page.goto(f"http://127.0.0.1:{server.server_address[1]}/")
                page.wait_for_selector("body[data-ready='1']", timeout=120_000)
                pages.append(time.perf_counter() - t0)
                assert page.locator("article.sample").count() == 20
                page.close()
                server.shutdown()
                server.server_close()
            browser.close()
        print(
            f"first page: median {statistics.median(pages):.2f} s over {args.repeats} (min {min(pages):.2f}, "
            f"max {max(pages):.2f})"
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
