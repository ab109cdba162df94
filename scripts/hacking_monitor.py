"""The hacking monitor against the exact onset (docs/hacking.md): per run, the step at which hacking began, the
monitor's first warning with and without the gold reward, and its lag; false alarms on runs that do not hack.

    python scripts/hacking_monitor.py RUN_DIR... [--figure docs/figures/hacking.png --figure-run RUN_DIR]

The exact onset of a run on the hackable task (data.embedded_task=digitsum_hack, exact proxy and gold at every
validation): the validation step of the best exact gold E_π[gold] before the first validation whose gold is below
the reference's (exact/ref_gold_mean); a run whose gold never falls below the reference's did not hack (onset
"none"). The monitor is replayed on each run's metrics.jsonl on the trainer's live schedule
(tether.diagnostics.LiveDiagnostics, every 10 steps): "with gold" sees every metric; "without gold" has the gold
metrics (val/gold_*, exact/gold_*) removed, as a run with no gold reward would log.

A warning on a run that did not hack is a false alarm, except on a guarded run (guard.on_hacking=rollback|stop):
"guard acted; no onset" where its guard rolled back or stopped at that step (the guard may be why the gold never fell).
A run without exact gold (a user's data files) has no exact onset: "n/a (no exact gold)", and it stays out of the β
table. Paths that are plain files are skipped (a sweep's glob also matches its sweep.yaml, table.md, *.png); a missing
path or a directory without metrics.jsonl is an error (exit 2).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from tether.diagnostics import HACKING_CHECKS, LIVE_EVERY, LiveDiagnostics, read_metrics

GOLD_KEYS = ("val/gold_", "exact/gold_", "exact/ref_gold_", "exact/opt_gold_")
EXACT_GOLD_KEYS = ("exact/gold_", "exact/ref_gold_", "exact/opt_gold_")


def run_dirs(paths: list[Path]) -> tuple[list[Path], list[str]]:
    """(the run directories among ``paths``, one message per path that cannot be one). A plain file is skipped
    silently (a sweep directory's glob, ``runs/hacking/fresh2/*``, also matches its ``sweep.yaml``, ``table.md``,
    ``*.png``); a missing path, or a directory without ``metrics.jsonl``, is a problem that names it."""
    runs, problems = [], []
    for p in paths:
        if (p / "metrics.jsonl").is_file():
            runs.append(p)
        elif p.is_dir():
            problems.append(f"cannot read run directory {p}: no metrics.jsonl")
        elif not p.exists():
            problems.append(f"cannot read run directory {p}: no such directory")
    if not problems and not runs:
        problems.append(f"no run directory among {' '.join(map(str, paths))}: give directories holding metrics.jsonl")
    return runs, problems


def read_runs(prog: str, paths: list[Path]) -> list[Path]:
    """:func:`run_dirs`, or each problem on a line of stderr (``PROG: ...``) and exit 2, as ``tether doctor`` does."""
    runs, problems = run_dirs(paths)
    for line in problems:
        print(f"{prog}: {line}", file=sys.stderr)
    if problems:
        raise SystemExit(2)
    return runs


def description(doc: str) -> str:
    """A script's ``--help`` description: the first paragraph of its docstring, its lines joined."""
    return " ".join(doc.strip().split("\n\n")[0].split())


#: The step events of a guard that acted: a hacking rollback, a validation's rollback, a stop (any guard's).
GUARD_ACTIONS = ("guard/hacking_rollback", "guard/rollback", "guard/stop")


def guard_actions(history: list[dict]) -> set[int]:
    """The steps at which the guard acted: rolled back (``guard/hacking_rollback``, ``guard/rollback``) or stopped
    (``guard/stop``)."""
    return {r["step"] for r in history if isinstance(r.get("step"), int) and any(r.get(k) for k in GUARD_ACTIONS)}


def guard_mode(run: Path) -> str:
    """The run's guard.on_hacking when it acts on a warning (``rollback`` or ``stop``, from its config.yaml), else
    ``""`` (``warn``, or no config.yaml)."""
    cfg = run / "config.yaml"
    lines = cfg.read_text().splitlines() if cfg.is_file() else []
    mode = next((ln.split(":")[-1].strip() for ln in lines if ln.strip().startswith("on_hacking:")), "")
    return mode if mode in ("rollback", "stop") else ""


def exact_onset(history: list[dict]) -> tuple[int | None, float | None, float | None]:
    """(onset step or None, gold at the onset, the reference's gold)."""
    vals = [
        (r["step"], r["exact/gold_mean"], r.get("exact/ref_gold_mean"))
        for r in history
        if isinstance(r.get("exact/gold_mean"), float)
    ]
    if not vals:
        return None, None, None
    ref = next((g for _, _, g in vals if g is not None), None)
    fall = next((s for s, g, _ in vals if ref is not None and g < ref), None)
    if fall is None:
        return None, None, ref
    before = [(g, -s) for s, g, _ in vals if s < fall]
    if not before:
        return fall, None, ref
    g, neg = max(before)
    return -neg, g, ref


def proxy_at_fall(history: list[dict], onset: int | None, ref: float | None) -> tuple[float | None, float | None]:
    """(exact proxy E_π[r] at the onset, at the first validation after it whose gold is below the reference's): a proxy
    that fell with the gold marks a run that broke (collapse), not one that hacked (the gold check, by design, stays
    silent there: it asks the training reward to hold)."""
    ex = {r["step"]: r for r in history if isinstance(r.get("exact/gold_mean"), float)}
    if onset is None or onset not in ex or ref is None:
        return None, None
    fall = next((s for s in sorted(ex) if s > onset and ex[s]["exact/gold_mean"] < ref), None)
    at = ex[onset].get("exact/score_mean")
    return at, (ex[fall].get("exact/score_mean") if fall is not None else None)


def warnings(history: list[dict], *, gold: bool | str) -> dict[str, list[int]]:
    """The steps each hacking check reported at on the live schedule (a check reports once while it keeps firing).
    gold: True (every metric), False (no gold metrics) or "sampled" (the exact gold removed: the check reads the
    sampled val/gold_mean with its val/gold_sem, as a run off the embedded prompts would)."""
    live = LiveDiagnostics(LIVE_EVERY)
    out: dict[str, list[int]] = {c: [] for c in HACKING_CHECKS}
    drop = () if gold is True else EXACT_GOLD_KEYS if gold == "sampled" else GOLD_KEYS
    for rec in sorted((r for r in history if isinstance(r.get("step"), int)), key=lambda r: r["step"]):
        if drop:
            rec = {k: v for k, v in rec.items() if not k.startswith(drop)}
        if rec["step"] == 0:  # the reference's validation: observed by the live monitor, not a call on its schedule
            live.observe(0, rec)
            continue
        for f in live.update(rec["step"], rec):
            if f.check in out:
                out[f.check].append(rec["step"])
    return out


def first_warnings(history: list[dict], *, gold: bool | str) -> dict[str, int | None]:
    """The first step each hacking check fired at on the live schedule (None: never)."""
    return {c: (steps[0] if steps else None) for c, steps in warnings(history, gold=gold).items()}


def analyse(run: Path) -> dict:
    h = read_metrics(run)
    onset, g_onset, ref = exact_onset(h)
    with_gold, without = first_warnings(h, gold=True), first_warnings(h, gold=False)
    sampled = first_warnings(h, gold="sampled") if any("val/gold_sem" in r for r in h) else {}
    cfg = (run / "config.yaml").read_text() if (run / "config.yaml").is_file() else ""
    final = next((r for r in reversed(h) if isinstance(r.get("exact/gold_mean"), float)), {})
    whole = {}  # the sweep's final exact evaluation on all 20 prompts (exact_final.json), when there is one
    if (run / "exact_final.json").is_file():
        whole = json.loads((run / "exact_final.json").read_text()).get("metrics", {})
    beta = next((r["kl/coef"] for r in h if isinstance(r.get("kl/coef"), float)), None)
    p_onset, p_fall = proxy_at_fall(h, onset, ref)
    seed = next((ln.split(":")[-1].strip() for ln in cfg.splitlines() if ln.strip().startswith("seed:")), "")
    return {
        "seed": seed,
        "proxy_at_onset": p_onset,
        "proxy_at_fall": p_fall,
        "kl_focus_warn": without.get("hacking_kl_focus"),
        "run": run.name,
        "onset": onset,
        "gold_at_onset": g_onset,
        "ref_gold": ref,
        "final_gold": final.get("exact/gold_mean"),
        "final_proxy": final.get("exact/score_mean"),
        "gold_warn": with_gold["hacking_gold"],
        "sampled_warn": sampled.get("hacking_gold"),
        "sampled": bool(sampled),
        "scenario": next((ln.split(":")[-1].strip() for ln in cfg.splitlines() if "tether.tasks.hacks:" in ln), ""),
        "proxy_warn_gold_run": with_gold["hacking_proxy"],
        "proxy_warn": without["hacking_proxy"],
        # a gold beside the training reward: the hack task, a library proxy, or any run that logs one
        "hackable": "digitsum_hack" in cfg
        or "tether.tasks.hacks:" in cfg
        or any(isinstance(r.get(k), float) for r in h for k in ("exact/gold_mean", "val/gold_mean")),
        "beta": beta,
        "guard": guard_mode(run),
        "guard_steps": guard_actions(h),
        "exact_gold": any(isinstance(r.get("exact/gold_mean"), float) for r in h),
        "all_gold": whole.get("exact/gold_mean"),
        "all_proxy": whole.get("exact/score_mean"),
        "all_ref_gold": whole.get("exact/ref_gold_mean"),
        "all_kl_tok": whole.get("exact/kl_ref_tok"),
    }


def label(a: dict) -> str:
    """A row's name: the run directory's, with the library scenario it trains on where the name does not say it
    (two runs of one scenario stay apart)."""
    if a["scenario"] and a["scenario"] not in a["run"]:
        return f"`{a['run']}` (`{a['scenario']}`)"
    return f"`{a['run']}`"


def lag(warn: int | None, a: dict) -> str:
    """A warning's cell: its step and its lag behind the exact onset of run ``a`` (an :func:`analyse` row). A warning
    on a run that did not hack is a false alarm, except on a guarded run (guard.on_hacking=rollback|stop), whose
    guard may have kept the gold from falling ("guard acted" where it rolled back or stopped at that step); without
    exact gold there is no onset to measure against."""
    if warn is None:
        return "never"
    if not a["exact_gold"]:
        return f"{warn} (no exact onset)"
    if a["onset"] is not None:
        return f"{warn} ({warn - a['onset']:+d})"
    if a["guard"]:
        return f"{warn} ({'guard acted' if warn in a['guard_steps'] else 'guarded run'}; no onset)"
    return f"{warn} (false alarm)"


def figure(run: Path, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    h = read_metrics(run)
    a = analyse(run)
    ex = [r for r in h if isinstance(r.get("exact/gold_mean"), float)]
    fig, ax = plt.subplots(figsize=(8, 4.8))
    ax.plot(
        [r["step"] for r in ex],
        [r["exact/score_mean"] for r in ex],
        "C0-o",
        ms=3,
        label="proxy E_π[r] (exact; trained on)",
    )
    ax.plot([r["step"] for r in ex], [r["exact/gold_mean"] for r in ex], "C3-o", ms=3, label="gold E_π[gold] (exact)")
    if a["ref_gold"] is not None:
        ax.axhline(a["ref_gold"], color="C3", ls=":", lw=1, label="reference's gold")
    kl = [(r["step"], r["kl/ref_mean"]) for r in h if isinstance(r.get("kl/ref_mean"), float) and r["step"] > 0]
    ax2 = ax.twinx()
    ax2.plot(*zip(*kl, strict=True), "C7-", lw=0.8, alpha=0.6, label="KL/token (sampled)")
    ax2.set_ylabel("KL(π‖π_ref) per token (nats)")
    for key, style, text in (
        ("onset", "k--", "exact onset"),
        ("gold_warn", "C3-", "monitor (gold)"),
        ("proxy_warn", "C0-", "monitor (no gold)"),
    ):
        if a[key] is not None:
            ax.axvline(
                a[key],
                color=style[:-1] if style[0] == "C" else "k",
                ls="--" if key == "onset" else "-",
                lw=1.2,
                label=f"{text}: step {a[key]}",
            )
    ax.set_xlabel("step")
    ax.set_ylabel("expected reward")
    ax.set_title(f"{run.name}: exact proxy and gold on the 4 validation prompts")
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    fig.legend(lines[0] + lines2[0], lines[1] + lines2[1], fontsize=7, loc="lower center", ncol=4, frameon=False)
    ax.set_xlim(0, max(r["step"] for r in h))
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog=Path(__file__).name, description=description(__doc__))
    ap.add_argument("runs", nargs="+", type=Path, help="run directories (plain files among them are skipped)")
    ap.add_argument("--figure", type=Path, help="write the --figure-run's exact proxy, gold and warnings here")
    ap.add_argument("--figure-run", type=Path, help="the run directory the --figure plots")
    args = ap.parse_args(argv)
    rows = [analyse(r) for r in read_runs(ap.prog, args.runs)]
    print(
        "| run | seed | exact onset | gold at onset → final (ref) | exact proxy at onset → at the fall | "
        "monitor with exact gold | with sampled gold | without gold: `hacking_proxy` | `hacking_kl_focus` |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for a in rows:
        at = "–" if a["gold_at_onset"] is None else f"{a['gold_at_onset']:.3f}"
        g = "–" if a["final_gold"] is None else f"{at} → {a['final_gold']:.3f} ({a['ref_gold']:.3f})"
        gold_warn = lag(a["gold_warn"], a) if a["hackable"] else "(no gold)"
        if not a["exact_gold"]:  # the replay with every metric reads the sampled gold: not this column's
            gold_warn = "n/a (no exact gold)"
        px = "–"
        if a["proxy_at_onset"] is not None and a["proxy_at_fall"] is not None:
            fell = " (fell: collapse)" if a["proxy_at_fall"] < a["proxy_at_onset"] else ""
            px = f"{a['proxy_at_onset']:.3f} → {a['proxy_at_fall']:.3f}{fell}"
        onset = "n/a (no exact gold)" if not a["exact_gold"] else a["onset"] if a["onset"] is not None else "none"
        print(
            f"| {label(a)} | {a['seed']} | {onset} | "
            f"{g} | {px} | {gold_warn} | "
            f"{lag(a['sampled_warn'], a) if a['sampled'] else '–'} | {lag(a['proxy_warn'], a)} | "
            f"{lag(a['kl_focus_warn'], a)} |"
        )
    by_beta: dict[tuple, list[dict]] = {}
    for a in rows:  # an onset is exact: runs without exact gold have none to count
        if a["hackable"] and a["exact_gold"] and a["beta"] is not None:
            by_beta.setdefault((a["guard"], a["beta"]), []).append(a)
    if by_beta:
        print(
            "\n| β (start) | runs | hacked (gold below the reference's at a validation) | exact onset | monitor with "
            "gold: lag | without gold: lag | final gold, 20 prompts | final proxy | KL/token |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        for (guard, beta), group in sorted(by_beta.items()):
            hacked = [a for a in group if a["onset"] is not None]
            lg = [a["gold_warn"] - a["onset"] for a in hacked if a["gold_warn"] is not None]
            lp = [a["proxy_warn"] - a["onset"] for a in hacked if a["proxy_warn"] is not None]
            # a guarded run's warning is the guard's trigger, and its gold never reaches the fall that defines an onset
            false_g = 0 if guard else sum(a["gold_warn"] is not None for a in group if a["onset"] is None)
            false_p = 0 if guard else sum(a["proxy_warn"] is not None for a in group if a["onset"] is None)

            def span(xs, fmt="{:+d}"):
                return (
                    "–"
                    if not xs
                    else (fmt.format(xs[0]) if min(xs) == max(xs) else f"{fmt.format(min(xs))} … {fmt.format(max(xs))}")
                )

            def mean(key, group=group):
                v = [a[key] for a in group if a[key] is not None]
                return f"{statistics.fmean(v):.3f} ({min(v):.3f}–{max(v):.3f})" if v else "–"

            onsets = sorted(a["onset"] for a in hacked)

            def lags_cell(lags, false, hacked=hacked):
                never = f", {len(hacked) - len(lags)} never" if len(lags) < len(hacked) else ""
                return f"{span(sorted(lags))}{never}{f', {false} false' if false else ''}"

            print(
                f"| {beta:g}{f' + guard.on_hacking={guard}' if guard else ''} | {len(group)} | "
                f"{len(hacked)}/{len(group)} | {span(onsets, '{:d}')} | {lags_cell(lg, false_g)} | "
                f"{lags_cell(lp, false_p)} | {mean('all_gold')} | {mean('all_proxy')} | {mean('all_kl_tok')} |"
            )
        refs = {round(a["all_ref_gold"], 4) for a in rows if a["all_ref_gold"] is not None}
        if refs:
            print(f"\nthe reference's gold on the 20 prompts: {', '.join(map(str, sorted(refs)))}")
    no_exact = sum(a["hackable"] and not a["exact_gold"] for a in rows)
    if no_exact:
        print(f"\n{no_exact} run(s) without exact gold (exact/gold_mean) have no exact onset: not in the β table")
    lags = [a["proxy_warn"] - a["onset"] for a in rows if a["onset"] is not None and a["proxy_warn"] is not None]
    if lags:
        print(
            f"\nwithout gold: median lag {statistics.median(lags):+.0f} steps over {len(lags)} hacked runs that warned"
        )
    if args.figure and args.figure_run:
        figure(args.figure_run, args.figure)
        print(f"figure: {args.figure}")


if __name__ == "__main__":
    main()
