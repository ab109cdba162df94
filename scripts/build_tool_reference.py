"""Rebuild the digitsum_tool task's reference (src/tether/tasks/assets/digitsum_tool_ref) and print its exact numbers.

    python scripts/build_tool_reference.py [OUT_DIR] [--seed 0] [--steps 1500]

Deterministic for a seed on a given CPU and torch build (single-threaded SFT; tether.tasks.digitsum_tool).
"""

from __future__ import annotations

import argparse
import time

from tether.tasks import digitsum_tool, sft


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", nargs="?", default=str(digitsum_tool.reference_path()))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=digitsum_tool.DEFAULT_STEPS)
    args = ap.parse_args()
    t0 = time.perf_counter()
    out = sft.build_tool_reference(args.out_dir, seed=args.seed, steps=args.steps, log_every=250)
    print(f"reference written to {out} in {time.perf_counter() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
