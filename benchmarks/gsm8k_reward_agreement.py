"""Agreement of tether's GSM8K reward with the human labels of ``example_model_solutions.jsonl``.

For each of the 1,319 test questions the file holds four real model solutions (GPT-3 6B and 175B,
fine-tuned and with a verifier), each labelled ``is_correct``. The reward is computed with the
ground truth taken as the number after ``A:`` in the file's ``ground_truth`` field, in strict and in
flexible mode, and compared with the label (reward 1.0 <=> correct).

Usage (from the project root)::

    python benchmarks/gsm8k_reward_agreement.py [--data ../shared/data/gsm8k/example_model_solutions.jsonl]
        [--show-disagreements N] [--json]

Prints a table: agreement overall and per model key, for both modes, and the number of false
positives (reward 1, label incorrect) and false negatives (reward 0, label correct). For
comparison it also scores a re-implementation of verl's documented ``gsm8k.py`` behaviour
(``verl-strict``, ``verl-flexible``; see :func:`verl_style_score`).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from tether.data.gsm8k import SOLUTION_MODEL_KEYS, gsm8k_final_answer  # noqa: E402
from tether.rewards.math import gsm8k_compute_score  # noqa: E402

DEFAULT_DATA = (
    Path(__file__).resolve().parents[1].parent / "shared" / "data" / "gsm8k" / "example_model_solutions.jsonl"
)


def verl_style_score(solution: str, ground_truth: str, method: str) -> float:
    """A re-implementation (for comparison only) of the behaviour verl's ``gsm8k.py`` documents:
    the solution clipped to its last 300 characters; strict: the last ``#### N`` (commas and ``$``
    removed); flexible: the last token of digits/``.``/``,`` (optional leading ``-``) that is not
    ``""`` or ``"."``; compared with the ground truth **as strings**."""
    s = solution[-300:]
    if method == "strict":
        found = re.findall(r"#### (-?[0-9.,]+)", s)
        ans = found[-1].replace(",", "").replace("$", "") if found else None
    else:
        ans = next((t for t in reversed(re.findall(r"(-?[0-9.,]+)", s)) if t not in ("", ".")), None)
    return 1.0 if ans is not None and ans == ground_truth else 0.0


def agreement(path: Path) -> dict:
    """Compute the agreement table.

    Returns:
        ``{"n": int, "modes": {mode: {"overall": {...}, "per_model": {key: {...}}}},
        "disagreements": {mode: [ {...}, ... ]}}`` where each ``{...}`` has ``n``, ``agree``,
        ``agreement`` (fraction), ``false_pos``, ``false_neg``.
    """
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    modes = ("strict", "flexible", "verl-strict", "verl-flexible")
    stats = {
        m: {k: {"n": 0, "agree": 0, "false_pos": 0, "false_neg": 0} for k in (*SOLUTION_MODEL_KEYS, "overall")}
        for m in modes
    }
    dis: dict[str, list] = {m: [] for m in modes}
    for qi, r in enumerate(rows):
        gt = gsm8k_final_answer(r["ground_truth"])
        for key in SOLUTION_MODEL_KEYS:
            sol, label = r[key]["solution"], bool(r[key]["is_correct"])
            for m in modes:
                if m.startswith("verl-"):
                    pred = verl_style_score(sol, gt, m[5:]) == 1.0
                else:
                    pred = gsm8k_compute_score(sol, gt, method=m) == 1.0
                for k in (key, "overall"):
                    s = stats[m][k]
                    s["n"] += 1
                    s["agree"] += pred == label
                    s["false_pos"] += pred and not label
                    s["false_neg"] += label and not pred
                if pred != label:
                    dis[m].append(
                        {
                            "question": qi,
                            "model": key,
                            "label": label,
                            "reward": float(pred),
                            "ground_truth": gt,
                            "solution_tail": sol[-160:],
                        }
                    )
    out = {"n": stats["flexible"]["overall"]["n"], "modes": {}, "disagreements": dis}
    for m in modes:
        for s in stats[m].values():
            s["agreement"] = s["agree"] / s["n"] if s["n"] else float("nan")
        out["modes"][m] = {"overall": stats[m]["overall"], "per_model": {k: stats[m][k] for k in SOLUTION_MODEL_KEYS}}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA)
    ap.add_argument(
        "--show-disagreements", type=int, default=0, metavar="N", help="print the first N disagreements of each mode"
    )
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    a = ap.parse_args(argv)
    if not a.data.is_file():
        print(f"data not found: {a.data}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    res = agreement(a.data)
    dt = time.perf_counter() - t0
    if a.json:
        print(json.dumps({k: v for k, v in res.items() if k != "disagreements"}, indent=1))
        return 0
    print(f"{res['n']} solutions from {a.data} ({dt:.2f} s)\n")
    print(
        f"| {'mode':13} | {'model':17} | {'n':>5} | {'agree':>5} | {'agreement':>9} | {'false +':>7} | {'false -':>7} |"
    )
    print(f"| {'-' * 13} | {'-' * 17} | {'-' * 5}:| {'-' * 5}:| {'-' * 9}:| {'-' * 7}:| {'-' * 7}:|")
    for m, d in res["modes"].items():
        items = [*d["per_model"].items(), ("overall", d["overall"])]
        if m.startswith("verl-"):
            items = items[-1:]
        for k, s in items:
            name = f"**{k}**" if k == "overall" else k
            print(
                f"| {m:13} | {name:17} | {s['n']:5d} | {s['agree']:5d} | {100 * s['agreement']:8.2f}% | "
                f"{s['false_pos']:7d} | {s['false_neg']:7d} |"
            )
    if a.show_disagreements:
        for m, lst in res["disagreements"].items():
            print(f"\n{m}: {len(lst)} disagreements")
            for d in lst[: a.show_disagreements]:
                print(
                    f"  q{d['question']} {d['model']} label={d['label']} reward={d['reward']} gt={d['ground_truth']} "
                    f"tail={d['solution_tail']!r}"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
