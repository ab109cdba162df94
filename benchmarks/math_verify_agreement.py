"""Agreement of the math-verify MATH verifier with the boxed string match it replaced, and with
human labels.

Three measurements (printed as tables; ``--json`` for the numbers):

1. **Hand-written MATH answer pairs** (:data:`CASES`): a boxed answer, a ground truth and whether
   they are the same answer (decided by hand). Each verifier's verdicts against that decision,
   and where the two disagree.
2. **GSM8K model solutions, boxed** (``example_model_solutions.jsonl``: 1,319 questions x 4 model
   solutions labelled ``is_correct``): each solution's final ``A: N`` line rewritten as
   ``The answer is $\\boxed{N}$`` (N exactly as the model wrote it), scored by
   ``math_compute_score`` (math-verify, then the fallback) and by ``math_boxed_compute_score`` (the
   old function), each against the label, and against each other.
3. **GSM8K model solutions, raw**: math-verify's own default extraction (no box, no anchor needed:
   the last number) against the label, beside tether's GSM8K reward (flexible) on the same text.

Usage (from the project root)::

    python benchmarks/math_verify_agreement.py [--data ../shared/data/gsm8k/example_model_solutions.jsonl] [--json]
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
from tether.rewards.math import (  # noqa: E402
    gsm8k_compute_score,
    math_boxed_compute_score,
    math_compute_score,
    math_verify_score,
)


def _default_data() -> Path:
    from tether.testing import find_gsm8k_dir

    d = find_gsm8k_dir(Path(__file__))
    return (d / "example_model_solutions.jsonl") if d else Path("../shared/data/gsm8k/example_model_solutions.jsonl")


#: (boxed answer, ground truth, the same answer?) decided by hand.
CASES = [
    ("\\frac{3}{4}", "0.75", True),
    ("3/4", "\\frac34", True),
    ("\\dfrac{3}{4}", "\\frac{3}{4}", True),
    ("0.750", "\\frac{3}{4}", True),
    ("1,000", "1000", True),
    ("\\$5", "5", True),
    ("5\\text{ cm}", "5", True),
    ("90^\\circ", "90", True),
    ("x=2", "2", True),
    ("2x+1", "1+2x", True),
    ("y=2x+1", "2x+1", True),
    ("2\\sqrt{2}", "\\sqrt{8}", True),
    ("\\frac{1}{\\sqrt{2}}", "\\frac{\\sqrt{2}}{2}", True),
    ("\\sqrt{2}/2", "\\frac{\\sqrt2}{2}", True),
    ("(1,2]", "(1,2]", True),
    ("\\{2,1\\}", "\\{1,2\\}", True),
    ("(2,3)", "(2,3)", True),
    ("10\\%", "10", True),
    ("\\pi", "\\pi", True),
    ("2\\pi", "\\pi \\cdot 2", True),
    ("-\\infty", "-\\infty", True),
    ("\\text{Evelyn}", "\\text{Evelyn}", True),
    ("\\textbf{(B)}", "\\text{(B)}", True),
    ("a+b", "b+a", True),
    ("\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", "\\begin{pmatrix}1\\\\2\\end{pmatrix}", True),
    ("6", "6.0", True),
    ("\\frac{6}{2}", "3", True),
    ("(-\\infty, 0) \\cup (0, \\infty)", "(-\\infty,0)\\cup(0,\\infty)", True),
    ("3", "4", False),
    ("(1,2)", "(1,2]", False),
    ("[1,2)", "[1,2]", False),
    ("(2,3)", "(3,2)", False),
    ("\\frac{1}{3}", "0.33", False),
    ("3.14", "\\pi", False),
    ("\\sqrt{2}", "2", False),
    ("2x", "x", False),
    ("-5", "5", False),
    ("x^2", "x^3", False),
    ("\\{1,2\\}", "\\{1,2,3\\}", False),
    ("12", "1,2", False),
    ("\\text{Bob}", "\\text{Evelyn}", False),
    ("0", "\\emptyset", False),
]


def _verdicts(fn, pairs):
    return [fn(f"The answer is $\\boxed{{{a}}}$.", gt) == 1.0 for a, gt, *_ in pairs]


def hand_cases() -> dict:
    """Verdicts of both verifiers on :data:`CASES`."""
    want = [c[2] for c in CASES]
    new, old = _verdicts(math_compute_score, CASES), _verdicts(math_boxed_compute_score, CASES)
    fallback = sum(math_verify_score(f"The answer is $\\boxed{{{a}}}$.", gt) is None for a, gt, _ in CASES)
    rows = [
        {"answer": a, "ground_truth": gt, "same": w, "math_verify": n, "boxed_match": o}
        for (a, gt, w), n, o in zip(CASES, new, old, strict=True)
    ]
    return {
        "n": len(CASES),
        "math_verify_right": sum(n == w for n, w in zip(new, want, strict=True)),
        "boxed_match_right": sum(o == w for o, w in zip(old, want, strict=True)),
        "agree": sum(n == o for n, o in zip(new, old, strict=True)),
        "fallback_used": fallback,
        "disagreements": [r for r in rows if r["math_verify"] != r["boxed_match"]],
        "math_verify_wrong": [r for r in rows if r["math_verify"] != r["same"]],
    }


_FINAL = re.compile(r"A:\s*(\S+)\s*$")


def gsm8k_solutions(path: Path) -> dict:
    """Measurements 2 and 3 on the labelled GSM8K model solutions."""
    from math_verify import parse, verify

    recs = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    keys = ("mv_boxed", "old_boxed", "mv_raw", "gsm8k_flexible")
    agree_label = dict.fromkeys(keys, 0)
    mv_vs_old = n = fallback = 0
    t0 = time.perf_counter()
    for rec in recs:
        gt = gsm8k_final_answer(rec["ground_truth"])
        gold = parse(f"${gt}$")
        for m in SOLUTION_MODEL_KEYS:
            sol = rec[m]["solution"]
            label = bool(rec[m]["is_correct"])
            boxed = _FINAL.sub(lambda mt: f"The answer is $\\boxed{{{mt.group(1)}}}$", sol.rstrip())
            v = math_verify_score(boxed, gt)
            fallback += v is None
            got = {
                "mv_boxed": math_compute_score(boxed, gt) == 1.0,
                "old_boxed": math_boxed_compute_score(boxed, gt) == 1.0,
                "mv_raw": bool(verify(gold, parse(sol))),
                "gsm8k_flexible": gsm8k_compute_score(sol, gt) == 1.0,
            }
            for k in keys:
                agree_label[k] += got[k] == label
            mv_vs_old += got["mv_boxed"] == got["old_boxed"]
            n += 1
    return {
        "n": n,
        "seconds": round(time.perf_counter() - t0, 1),
        "fallback_used": fallback,
        "mv_boxed_vs_old_boxed": mv_vs_old,
        "agree_with_label": agree_label,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--data", type=Path, default=None, help="default: ../shared/data/gsm8k/example_model_solutions.jsonl"
    )
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    a.data = a.data or _default_data()
    hand = hand_cases()
    sols = gsm8k_solutions(a.data) if a.data.is_file() else None
    if a.json:
        print(json.dumps({"hand": hand, "gsm8k": sols}, indent=2))
        return 0
    h = hand
    print(
        f"1. hand-written MATH pairs ({h['n']}; math-verify could not parse {h['fallback_used']}, the fallback decided "
        "those)"
    )
    print("| verifier | right (vs hand decision) |\n|---|---|")
    print(f"| math-verify (math_compute_score) | {h['math_verify_right']}/{h['n']} |")
    print(f"| boxed string match (math_boxed_compute_score) | {h['boxed_match_right']}/{h['n']} |")
    print(f"the two agree on {h['agree']}/{h['n']}; they differ on:")
    for r in h["disagreements"]:
        print(
            f"  {r['answer']!r} vs {r['ground_truth']!r}: same={r['same']}, math-verify={r['math_verify']}, boxed "
            f"match={r['boxed_match']}"
        )
    for r in h["math_verify_wrong"]:
        print(f"  math-verify wrong: {r['answer']!r} vs {r['ground_truth']!r} (same={r['same']})")
    if sols is None:
        print(f"(no {a.data}: GSM8K measurements skipped)")
        return 0
    s = sols
    print(
        f"\n2./3. GSM8K model solutions ({s['n']}, {s['seconds']} s; {s['fallback_used']} have no final 'A: N' line to "
        "box, math-verify finds no answer in them and the fallback scores them 0)"
    )
    print("| verifier on | agrees with is_correct |\n|---|---|")
    names = {
        "mv_boxed": "math-verify, final answer boxed",
        "old_boxed": "boxed string match, final answer boxed",
        "mv_raw": "math-verify default extraction, raw solution",
        "gsm8k_flexible": "tether GSM8K reward (flexible), raw solution",
    }
    for k, name in names.items():
        print(f"| {name} | {s['agree_with_label'][k]}/{s['n']} ({s['agree_with_label'][k] / s['n']:.2%}) |")
    print(f"math-verify and the boxed match agree on {s['mv_boxed_vs_old_boxed']}/{s['n']} boxed solutions")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
