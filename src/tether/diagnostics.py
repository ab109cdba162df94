"""Training health checks over the per-step metrics history (``tether doctor`` and live warnings).

A *history* is a list of dicts, one per logged step, as written line by line to ``metrics.jsonl``
in a run directory: each has an integer ``"step"`` and metric keys such as ``kl/ref_mean``. Every
check reads the series of one or two metrics from it:

* only finite real numbers count (a step where a metric is missing, ``None``, NaN or not a number
  is skipped for that metric), so metrics logged at different rates mix freely;
* steps are deduplicated (the last record of a step wins, as after a resumed run re-logs steps)
  and sorted.

Checks (thresholds are keyword arguments of each function, defaults in brackets; windows count
*logged points* of the metric, not training steps):

* ``kl_rising`` (``kl/ref_mean``): after the first ``warmup`` [30] points (the policy leaving the reference), over
  the last ``window`` [20] points (at least ``min_points`` [10]), Kendall τ ≥ ``min_tau`` [0.5], the Theil–Sen
  fit rises by ≥ ``min_rel_rise`` [20 %] and ends at ≥ ``floor`` [0.05 nats/token; ``kl.target`` if higher under an
  adaptive controller].
* ``entropy_collapse`` (``policy/entropy``): the median of the last ``recent`` [5] points fell by
  more than ``max_drop`` [50 %] from the median of the first ``early`` [5], or is below ``floor``
  [0.05 nats/token].
* ``length_shrinking`` (``response/length_mean``): recent median fell by more than ``max_drop``
  [30 %] from the early median.
* ``reward_flat_kl_growing`` (``reward/score_mean``): after the first ``warmup`` [30] points, over the last
  ``window`` [20] points the
  reward has Kendall τ ≤ ``max_reward_tau`` [0.2] while the KL rises (τ ≥ 0.5, fit +20 %, ends
  ≥ ``kl_floor`` [0.02]).
* ``clipfrac_high`` (``policy/clipfrac``): the last ``patience`` [5] points all exceed
  ``threshold`` [0.2].
* ``collapse_rising`` (``diversity/collapse_rate``): recent median exceeds the early median by
  ≥ ``min_rise`` [0.2, absolute].
* ``no_learning_signal`` (``rollout/zero_var_group_frac``, ``advantages/abs_mean``,
  ``policy/grad_norm``): over the last ``window`` [10] points (at least ``min_points`` [5]) the
  fraction of prompts whose samples all got the same reward averages ≥ ``max_flat_frac`` [0.9],
  or |advantage| or the gradient norm stayed ≤ ``tol`` [1e-8].
* ``hacking_gold`` (``exact/gold_mean`` or ``val/gold_mean`` with the training reward): the gold's upper confidence
  bound (``z`` [2] standard errors) fell more than ``min_rel_drop`` [10 %] below the best earlier lower bound while
  the training reward held, at ``persist`` [2] validations in a row for a sampled gold, or once if the fall is
  ``sharp_z`` [5] standard errors (one fall for an exact gold).
* ``hacking_proxy`` (``kl/ref_mean`` with ``response/length_mean``): the KL's slope jumped ``kl_accel`` [3]× within the
  last ``lookback`` [20] points (windows of ``window`` [10], at least ``min_kl_slope`` [0.005]/step) and the length's
  median drifted ≥ ``min_len_drift`` [5 %], while ``reward/score_mean`` is not falling (τ > ``min_reward_tau`` [0]).
* ``hacking_kl_focus`` (``kl/token_top_share`` with ``kl/ref_mean``): the median of the last ``window`` [10] points of
  the KL's share on its heaviest token id is ≥ ``min_share`` [0.45] at a KL ≥ ``min_kl`` [0.1 nats/token], while the
  training reward is not falling (τ > ``min_reward_tau`` [0]).

Each :class:`Finding` names the metric, carries the evidence (``steps`` and ``values`` of the
points the check looked at, plus the statistics it computed) and a concrete suggestion naming the
config key to change, with its current value where the run's config (or ``kl/coef``) says it.

Robust statistics: Theil–Sen slope (Theil 1950; Sen 1968: the median of pairwise slopes) and
Kendall's τ-a (Kendall 1938), both insensitive to a few outlying steps. See ``docs/diagnostics.md``.
"""

from __future__ import annotations

import inspect
import json
import logging
import math
import statistics
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TextIO

__all__ = [
    "CHECKS",
    "HACKING_CHECKS",
    "GUARDED_HACKING_CHECKS",
    "LIVE_EVERY",
    "Finding",
    "LiveDiagnostics",
    "check_clipfrac_high",
    "check_collapse_rising",
    "check_entropy_collapse",
    "check_hacking_gold",
    "check_hacking_kl_focus",
    "check_hacking_proxy",
    "check_kl_rising",
    "check_length_shrinking",
    "check_no_learning_signal",
    "check_reward_flat_kl_growing",
    "cleared_findings",
    "diagnose",
    "gold_fall_flags",
    "gold_warn_flags",
    "doctor",
    "format_findings",
    "read_metrics",
]

log = logging.getLogger("tether")

METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.yaml"

History = Sequence[Mapping[str, Any]]


@dataclass(frozen=True)
class Finding:
    """One diagnostic result.

    Attributes:
        check: name of the check that fired (a key of :data:`CHECKS`, or ``"metrics_file"`` for a
            problem reading ``metrics.jsonl``).
        metric: the metric the finding is about, e.g. ``"kl/ref_mean"``.
        message: one human sentence with the numbers.
        evidence: ``{"steps": [...], "values": [...], ...}``: the points the check looked at and
            the statistics it computed (all JSON-serialisable).
        suggestion: a concrete change naming the config key(s), e.g. ``"raise kl.coef (now 0.05) ..."``.
        severity: ``"warning"`` (something is likely wrong) or ``"info"``.
        overrides: the changes the suggestion proposes, each alternative a ``{dotted key: value}`` mapping (e.g.
            ``({"kl.coef": 0.1}, {"actor.lr": 1.5e-4})``); with the run's config, only changes that config accepts
            (a key its own settings refuse, such as ``algo.clip_eps_high`` under ``algo.policy_loss=gspo``, is never
            suggested). The suggestion names no config key that is not in one of them, ``reward.val_function`` (a
            file the user writes) aside.
    """

    check: str
    metric: str
    message: str
    evidence: dict = field(default_factory=dict)
    suggestion: str = ""
    severity: Literal["warning", "info"] = "warning"
    overrides: tuple[dict[str, Any], ...] = ()


# --------------------------------------------------------------------------------------------------
# series and robust statistics
# --------------------------------------------------------------------------------------------------
_INF_SENTINEL = 1e308  # metrics.jsonl writes ±inf as ±1e308 (tether.trainer.logging), NaN as null


def _number(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    v = float(v)
    # a logged ±inf reads back as ±1e308: skip it as the live check skips the inf it was given
    return v if math.isfinite(v) and abs(v) < _INF_SENTINEL else None


def _series(history: History, key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of ``key``: finite numbers only, deduplicated by step (last wins), sorted."""
    by_step: dict[int, float] = {}
    for rec in history:
        step = rec.get("step")
        if isinstance(step, bool) or not isinstance(step, int):
            continue
        v = _number(rec.get(key))
        if v is not None:
            by_step[step] = v
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def _theil_sen(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Theil–Sen line: slope = median of pairwise slopes, intercept = median of y − slope·x."""
    slopes = [
        (ys[j] - ys[i]) / (xs[j] - xs[i]) for i in range(len(xs)) for j in range(i + 1, len(xs)) if xs[j] != xs[i]
    ]
    slope = statistics.median(slopes) if slopes else 0.0
    intercept = statistics.median([y - slope * x for x, y in zip(xs, ys, strict=True)])
    return slope, intercept


def _kendall_tau(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Kendall's τ-a: (concordant − discordant pairs) / all pairs; ties count 0. In [−1, 1]."""
    n = len(xs)
    if n < 2:
        return 0.0
    s = 0
    for i in range(n):
        for j in range(i + 1, n):
            d = (xs[j] - xs[i]) * (ys[j] - ys[i])
            s += (d > 0) - (d < 0)
    return s / (n * (n - 1) / 2)


def _trend(steps: list[int], values: list[float]) -> dict[str, float]:
    slope, intercept = _theil_sen(steps, values)
    start = intercept + slope * steps[0]
    end = intercept + slope * steps[-1]
    rel = (end - start) / start if start > 0 else (math.inf if end > start else 0.0)
    return {
        "slope_per_step": slope,
        "kendall_tau": _kendall_tau(steps, values),
        "fit_start": start,
        "fit_end": end,
        "rel_rise": rel,
    }


# --------------------------------------------------------------------------------------------------
# suggestion helpers
# --------------------------------------------------------------------------------------------------
def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _cfg(config: Any, dotted: str) -> Any:
    """Value of ``dotted`` (``"kl.coef"``) in a nested mapping or attribute config; None if absent."""
    node = config
    for part in dotted.split("."):
        if node is None:
            return None
        node = node.get(part) if isinstance(node, Mapping) else getattr(node, part, None)
    return node


def _now(config: Any, dotted: str, value: Any = None) -> str:
    """``"kl.coef (now 0.05)"``, or just ``"kl.coef"`` when the current value is unknown."""
    if value is None:
        value = _cfg(config, dotted)
    return f"{dotted} (now {_fmt(value)})" if value is not None else dotted


def _kl_coef_now(history: History, config: Any) -> float | None:
    """β now: the last ``kl/coef_next`` (after the step's controller and any guard: a hacking rollback's floor
    included), else the last ``kl/coef``, else the config's ``kl.coef``."""
    for key in ("kl/coef_next", "kl/coef"):
        _, coefs = _series(history, key)
        if coefs:
            return coefs[-1]
    v = _cfg(config, "kl.coef")
    return float(v) if isinstance(v, (int, float)) else None


def _raise_kl_coef(history: History, config: Any) -> str:
    coef = _kl_coef_now(history, config)
    if coef is None:
        return "raise kl.coef"
    if coef == 0:
        return "set kl.coef=0.05 (now 0: nothing tethers the policy to the reference)"
    return f"raise kl.coef (now {_fmt(coef)}) to {_fmt(2 * coef)}"


def _raise_kl_coef_change(history: History, config: Any) -> dict[str, Any]:
    """The override :func:`_raise_kl_coef` names: kl.coef doubled, or 0.05 from 0; {} when β is unknown."""
    coef = _kl_coef_now(history, config)
    if coef is None:
        return {}
    return {"kl.coef": 0.05 if coef == 0 else 2 * coef}


def _scaled(config: Any, dotted: str, factor: float) -> dict[str, Any]:
    """``{dotted: value × factor}`` for a positive number in ``config``; {} when it is unknown."""
    v = _cfg(config, dotted)
    return {dotted: v * factor} if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 else {}


def _raise_temperature(config: Any) -> tuple[str, dict[str, Any]]:
    """("raise rollout.temperature (now t)", {rollout.temperature: 1.25 t}); nothing where the run's settings refuse
    another temperature (actor.old_logprobs_source=rollout with greedy decoding keeps it at 1)."""
    if _cfg(config, "actor.old_logprobs_source") == "rollout" and _cfg(config, "rollout.do_sample") is False:
        return "", {}
    return f"raise {_now(config, 'rollout.temperature')}", _scaled(config, "rollout.temperature", 1.25)


def _entropy_bonus(config: Any) -> tuple[str, dict[str, Any]]:
    """The entropy bonus to suggest: a larger algo.entropy_target under the adaptive bonus (its α moves itself, and a
    starting α above algo.entropy_coef_max is refused), else algo.entropy_coef doubled or 0.001 from 0."""
    target = _cfg(config, "algo.entropy_target")
    if isinstance(target, (int, float)):
        return f"raise {_now(config, 'algo.entropy_target')} (the entropy the bonus holds)", {
            "algo.entropy_target": 1.5 * target
        }
    ent = _cfg(config, "algo.entropy_coef")
    if isinstance(ent, (int, float)) and ent > 0:
        return f"raise algo.entropy_coef (now {_fmt(ent)}) to {_fmt(2 * ent)}", {"algo.entropy_coef": 2 * ent}
    return f"add an entropy bonus, e.g. algo.entropy_coef=0.001{' (now 0)' if ent == 0 else ''}", {
        "algo.entropy_coef": 0.001
    }


def _options(*pairs: tuple[str, dict[str, Any]]) -> tuple[list[str], tuple[dict[str, Any], ...]]:
    """The texts and overrides of the suggestion's alternatives, those with no text left out."""
    kept = [(t, o) for t, o in pairs if t]
    return [t for t, _ in kept], tuple(o for _, o in kept if o)


def _head_tail(steps: list[int], values: list[float], early: int, recent: int) -> dict[str, Any]:
    e_steps, e_vals = steps[:early], values[:early]
    r_steps, r_vals = steps[-recent:], values[-recent:]
    return {
        "steps": e_steps + r_steps,
        "values": e_vals + r_vals,
        "early_median": statistics.median(e_vals),
        "recent_median": statistics.median(r_vals),
    }


# --------------------------------------------------------------------------------------------------
# checks
# --------------------------------------------------------------------------------------------------
def check_kl_rising(
    history: History,
    *,
    window: int = 20,
    min_points: int = 10,
    min_tau: float = 0.5,
    min_rel_rise: float = 0.2,
    floor: float = 0.05,
    warmup: int = 30,
    config: Any = None,
) -> list[Finding]:
    """KL to the reference rising steadily (``kl/ref_mean``, nats per token).

    Leaves out the series' first ``warmup`` points: there the policy leaves the reference (KL 0 at step 1), which
    every run does before its KL levels off (on the demo between steps 20 and 40), so a rise among them is not drift.
    Looks at the last ``window`` of the remaining points (needs at least ``min_points``). Fires when all hold:
    Kendall's τ between step and KL is ≥ ``min_tau`` (a mostly monotone rise); the Theil–Sen fit
    rises by at least ``min_rel_rise`` of its starting value over the window; and the fit ends at
    or above ``floor`` (a rise among tiny values is not worth a warning; 0.05 nats/token is the top
    of the range a fixed β = 0.05 is reported to hold). When ``config`` says the controller is
    adaptive or exponential, the floor is raised to ``kl.target`` (``kl.high`` for band): rising
    up to the target is what such a controller is for.

    Suggests raising ``kl.coef`` or the adaptive controller; if ``kl/coef`` already rose over the
    window, lowering ``kl.target``; if the run measures KL without penalising it, ``kl.placement``.
    """
    steps, values = _series(history, "kl/ref_mean")
    steps, values = steps[warmup:][-window:], values[warmup:][-window:]
    if len(steps) < max(2, min_points):
        return []
    t = _trend(steps, values)
    if not (t["kendall_tau"] >= min_tau and t["slope_per_step"] > 0 and t["rel_rise"] >= min_rel_rise):
        return []
    controller = _cfg(config, "kl.controller")
    target = _cfg(config, "kl.high" if controller == "band" else "kl.target")
    if controller in ("adaptive", "exponential", "band") and isinstance(target, (int, float)):
        floor = max(floor, float(target))  # rising up to the controller's target is intended
    if t["fit_end"] < floor:
        return []
    c_steps, c_vals = _series(history, "kl/coef")
    c_vals = [v for s, v in zip(c_steps, c_vals, strict=True) if steps[0] <= s <= steps[-1]]
    placement = _cfg(config, "kl.placement")
    lr = _scaled(config, "actor.lr", 0.5)
    if placement == "none":
        coef = _kl_coef_now(history, config)
        suggestion = (
            "set kl.placement=reward or kl.placement=loss (now none: the KL is measured but never penalised), with "
            f"{_now(config, 'kl.coef', coef)}"
        )
        # with β = 0 a placement would still penalise nothing
        keep = {"kl.coef": 0.05 if coef == 0 else coef} if coef is not None else {}
        overrides = ({"kl.placement": "reward", **keep}, {"kl.placement": "loss", **keep})
    elif c_vals and c_vals[0] > 0 and c_vals[-1] > 1.05 * c_vals[0]:
        if controller == "band":  # its target is the band's top, which must stay above kl.low
            high, low = _cfg(config, "kl.high"), _cfg(config, "kl.low")
            target_txt = f"lower {_now(config, 'kl.high')}"
            target = (
                {"kl.high": (high + low) / 2}
                if isinstance(high, (int, float)) and isinstance(low, (int, float))
                else {}
            )
        else:
            target_txt, target = f"lower {_now(config, 'kl.target')}", _scaled(config, "kl.target", 0.5)
        beta_max = _scaled(config, "kl.beta_max", 2.0)
        texts, overrides = _options(
            (target_txt, target),
            (f"raise {_now(config, 'kl.beta_max')}" if beta_max else "", beta_max),
        )
        suggestion = (
            f"kl/coef already rose from {_fmt(c_vals[0])} to {_fmt(c_vals[-1])} and the KL still climbs: "
            f"{' or '.join(texts)}, and lower {_now(config, 'actor.lr')} to slow the drift"
        )
        overrides += (lr,) if lr else ()
    else:
        suggestion = (
            f"{_raise_kl_coef(history, config)}, or set kl.controller=adaptive with kl.target={_fmt(floor)} "
            "(nats/token, the kl/ref_mean scale) so β grows while KL exceeds the target; lowering "
            f"{_now(config, 'actor.lr')} also slows the drift"
        )
        adaptive = {"kl.controller": "adaptive", "kl.target": floor}
        overrides = tuple(o for o in (_raise_kl_coef_change(history, config), adaptive, lr) if o)
    msg = (
        f"kl/ref_mean rose steadily from {_fmt(t['fit_start'])} to {_fmt(t['fit_end'])} nats/token over steps "
        f"{steps[0]}–{steps[-1]} (Theil–Sen slope {_fmt(t['slope_per_step'])}/step, Kendall τ {t['kendall_tau']:.2f}), "
        f"above the {_fmt(floor)} floor"
    )
    evidence = {"steps": steps, "values": values, **t, "floor": floor}
    return [Finding("kl_rising", "kl/ref_mean", msg, evidence, suggestion, overrides=overrides)]


def check_entropy_collapse(
    history: History,
    *,
    early: int = 5,
    recent: int = 5,
    max_drop: float = 0.5,
    floor: float = 0.05,
    config: Any = None,
) -> list[Finding]:
    """Policy entropy collapsing (``policy/entropy``, nats per token).

    Early level = median of the first ``early`` points, current level = median of the last
    ``recent`` points. Fires when the current level is below ``floor`` (needs ``recent`` points),
    or when it fell by more than ``max_drop`` (a fraction) from the early level (needs
    ``early + recent`` points, so the two never overlap).

    Suggests a higher ``rollout.temperature``, an entropy bonus ``algo.entropy_coef`` and a larger
    ``kl.coef`` (the KL term keeps the policy near the reference's entropy).
    """
    steps, values = _series(history, "policy/entropy")
    if len(steps) < recent:
        return []
    if len(steps) >= early + recent:
        ev = _head_tail(steps, values, early, recent)
        drop = 1.0 - ev["recent_median"] / ev["early_median"] if ev["early_median"] > 0 else 0.0
    else:
        ev = {
            "steps": steps[-recent:],
            "values": values[-recent:],
            "recent_median": statistics.median(values[-recent:]),
        }
        drop = None
    below_floor = ev["recent_median"] < floor
    if not (below_floor or (drop is not None and drop > max_drop)):
        return []
    ev.update(drop=drop, max_drop=max_drop, floor=floor)
    if drop is not None:
        msg = (
            f"policy/entropy fell {100 * drop:.0f}% from {_fmt(ev['early_median'])} (median of steps "
            f"{steps[0]}–{steps[early - 1]}) to {_fmt(ev['recent_median'])} (median of steps "
            f"{steps[-recent]}–{steps[-1]})"
        )
    else:
        msg = f"policy/entropy is {_fmt(ev['recent_median'])} (median of steps {steps[-recent]}–{steps[-1]})"
    if below_floor:
        msg += f", below the {_fmt(floor)} nats/token floor"
    texts, overrides = _options(
        _raise_temperature(config),
        _entropy_bonus(config),
        (_raise_kl_coef(history, config), _raise_kl_coef_change(history, config)),
    )
    suggestion = f"{', '.join(texts[:-1])}, or {texts[-1]} to keep the policy closer to the reference's entropy"
    return [Finding("entropy_collapse", "policy/entropy", msg, ev, suggestion, overrides=overrides)]


def check_length_shrinking(
    history: History,
    *,
    early: int = 5,
    recent: int = 5,
    max_drop: float = 0.3,
    config: Any = None,
) -> list[Finding]:
    """Response length shrinking (``response/length_mean``, tokens).

    Fires when the median of the last ``recent`` points fell by more than ``max_drop`` (a fraction)
    from the median of the first ``early`` points (needs ``early + recent`` points).

    Suggests ``kl.placement=loss`` (a per-token KL penalty summed into the reward makes every extra
    token cost, so shorter responses pay less), a lower ``kl.coef``, and checking the reward for a
    length bias.
    """
    steps, values = _series(history, "response/length_mean")
    if len(steps) < early + recent:
        return []
    ev = _head_tail(steps, values, early, recent)
    if ev["early_median"] <= 0:
        return []
    drop = 1.0 - ev["recent_median"] / ev["early_median"]
    if not drop > max_drop:
        return []
    ev.update(drop=drop, max_drop=max_drop)
    msg = (
        f"response/length_mean shrank {100 * drop:.0f}% from {_fmt(ev['early_median'])} tokens (median of steps "
        f"{steps[0]}–{steps[early - 1]}) to {_fmt(ev['recent_median'])} (median of steps {steps[-recent]}–{steps[-1]})"
    )
    placement = _cfg(config, "kl.placement")
    coef = _kl_coef_now(history, config)
    lower = {"kl.coef": coef / 2} if coef else {}  # β = 0 (or unknown): nothing to lower
    coef_txt = f", or lower {_now(config, 'kl.coef', coef)}" if lower or coef is None else ""
    if placement in ("reward", "both", None):
        now = f" (now {placement})" if placement else ""
        suggestion = (
            f"a KL penalty in the reward{now} is summed over tokens, so shorter responses pay less: try "
            f"kl.placement=loss{coef_txt}; also check the reward function for a length bias"
        )
        overrides = ({"kl.placement": "loss"},) + ((lower,) if lower else ())
    else:
        suggestion = f"check the reward function for a length bias{coef_txt}"
        overrides = (lower,) if lower else ()
    return [Finding("length_shrinking", "response/length_mean", msg, ev, suggestion, overrides=overrides)]


def check_reward_flat_kl_growing(
    history: History,
    *,
    window: int = 20,
    min_points: int = 10,
    max_reward_tau: float = 0.2,
    min_kl_tau: float = 0.5,
    min_kl_rel_rise: float = 0.2,
    kl_floor: float = 0.02,
    warmup: int = 30,
    config: Any = None,
) -> list[Finding]:
    """Reward flat (or falling) while the KL to the reference grows: drift without gain.

    Leaves out the first ``warmup`` points of each series (the policy leaving the reference, as in
    :func:`check_kl_rising`). Over the last ``window`` remaining points of each (at least ``min_points``): Kendall's τ
    of
    ``reward/score_mean`` against step is ≤ ``max_reward_tau`` (no upward trend; scale-free, so no
    reward units are assumed), while ``kl/ref_mean`` has τ ≥ ``min_kl_tau``, a Theil–Sen fit rising
    by ≥ ``min_kl_rel_rise`` and ending at ≥ ``kl_floor`` nats/token.

    Suggests a lower ``actor.lr``, a larger ``kl.coef``, and checking the reward signal.
    """
    r_steps, r_vals = _series(history, "reward/score_mean")
    k_steps, k_vals = _series(history, "kl/ref_mean")
    r_steps, r_vals = r_steps[warmup:][-window:], r_vals[warmup:][-window:]
    k_steps, k_vals = k_steps[warmup:][-window:], k_vals[warmup:][-window:]
    if min(len(r_steps), len(k_steps)) < max(2, min_points):
        return []
    r_tau = _kendall_tau(r_steps, r_vals)
    kt = _trend(k_steps, k_vals)
    if not (r_tau <= max_reward_tau and kt["kendall_tau"] >= min_kl_tau and kt["slope_per_step"] > 0):
        return []
    if kt["rel_rise"] < min_kl_rel_rise or kt["fit_end"] < kl_floor:
        return []
    r_med = statistics.median(r_vals)
    msg = (
        f"reward/score_mean shows no upward trend over steps {r_steps[0]}–{r_steps[-1]} (Kendall τ {r_tau:.2f}, median "
        f"{_fmt(r_med)}) while kl/ref_mean grew from {_fmt(kt['fit_start'])} to {_fmt(kt['fit_end'])} nats/token: the "
        "policy drifts from the reference without gaining reward"
    )
    evidence = {
        "steps": r_steps,
        "values": r_vals,
        "reward_kendall_tau": r_tau,
        "reward_median": r_med,
        "kl_steps": k_steps,
        "kl_values": k_vals,
        **{f"kl_{k}": v for k, v in kt.items()},
    }
    suggestion = (
        f"lower {_now(config, 'actor.lr')}, e.g. halve it, and {_raise_kl_coef(history, config)}; check that the "
        "reward function still separates good from bad responses (a saturated or mis-wired reward gives no gradient "
        "signal)"
    )
    overrides = tuple(o for o in (_scaled(config, "actor.lr", 0.5), _raise_kl_coef_change(history, config)) if o)
    return [Finding("reward_flat_kl_growing", "reward/score_mean", msg, evidence, suggestion, overrides=overrides)]


def check_clipfrac_high(
    history: History,
    *,
    threshold: float = 0.2,
    patience: int = 5,
    config: Any = None,
) -> list[Finding]:
    """PPO clip fraction high for several steps (``policy/clipfrac``, fraction of tokens clipped).

    Fires when each of the last ``patience`` points exceeds ``threshold``. Evidence includes
    ``run_length``, the number of consecutive points above the threshold up to the latest one.

    Suggests a lower ``actor.lr`` or fewer ``algo.ppo_epochs``; widening ``algo.clip_eps_high`` /
    ``algo.clip_eps_low`` would only hide the symptom.
    """
    steps, values = _series(history, "policy/clipfrac")
    if len(steps) < patience or not all(v > threshold for v in values[-patience:]):
        return []
    run = 0
    for v in reversed(values):
        if v <= threshold:
            break
        run += 1
    ev = {"steps": steps[-patience:], "values": values[-patience:], "run_length": run, "threshold": threshold}
    msg = (
        f"policy/clipfrac has exceeded {_fmt(threshold)} for the last {run} logged steps ({steps[-run]}–{steps[-1]}; "
        f"latest {_fmt(values[-1])}): the updates move the policy well past the clip range"
    )
    epochs = _cfg(config, "algo.ppo_epochs")
    fewer = {"algo.ppo_epochs": epochs - 1} if isinstance(epochs, int) and epochs > 1 else {}
    texts, overrides = _options(
        (_now(config, "actor.lr"), _scaled(config, "actor.lr", 0.5)),
        (_now(config, "algo.ppo_epochs") if fewer or epochs is None else "", fewer),
    )
    # the clip range is each policy loss's own setting (algo.clip_eps_* for vanilla, algo.gspo.* for gspo, ...):
    # not named, since widening it is not the advice
    suggestion = f"lower {' or '.join(texts)}; widening the policy loss's clip range would only hide the symptom"
    return [Finding("clipfrac_high", "policy/clipfrac", msg, ev, suggestion, overrides=overrides)]


def check_collapse_rising(
    history: History,
    *,
    early: int = 5,
    recent: int = 5,
    min_rise: float = 0.2,
    config: Any = None,
) -> list[Finding]:
    """Mode collapse rising (``diversity/collapse_rate``, share of prompts whose samples are identical).

    Fires when the median of the last ``recent`` points exceeds the median of the first ``early``
    points by at least ``min_rise`` (absolute, the rate is in [0, 1]); needs ``early + recent`` points.

    Suggests a larger ``kl.coef`` (the tether keeps the reference's diversity), a higher
    ``rollout.temperature`` and an entropy bonus ``algo.entropy_coef``.
    """
    steps, values = _series(history, "diversity/collapse_rate")
    if len(steps) < early + recent:
        return []
    ev = _head_tail(steps, values, early, recent)
    rise = ev["recent_median"] - ev["early_median"]
    if not rise >= min_rise:
        return []
    ev.update(rise=rise, min_rise=min_rise)
    msg = (
        f"diversity/collapse_rate rose from {_fmt(ev['early_median'])} (median of steps {steps[0]}–{steps[early - 1]}) "
        f"to {_fmt(ev['recent_median'])} (median of steps {steps[-recent]}–{steps[-1]}): more prompts get n identical "
        "samples"
    )
    texts, overrides = _options(
        (
            f"{_raise_kl_coef(history, config)} to keep the reference's diversity",
            _raise_kl_coef_change(history, config),
        ),
        _raise_temperature(config),
        _entropy_bonus(config),
    )
    suggestion = f"{', '.join(texts[:-1])}, or {texts[-1]}"
    return [Finding("collapse_rising", "diversity/collapse_rate", msg, ev, suggestion, overrides=overrides)]


def check_no_learning_signal(
    history: History,
    *,
    window: int = 10,
    min_points: int = 5,
    max_flat_frac: float = 0.9,
    tol: float = 1e-8,
    config: Any = None,
) -> list[Finding]:
    """No learning signal: the rewards never differ within a prompt's group, or nothing reaches the gradient.

    Over the last ``window`` logged points of each metric (at least ``min_points``), fires when any holds:

    * ``rollout/zero_var_group_frac`` (fraction of prompts whose samples all got the same reward)
      averages ≥ ``max_flat_frac``: group-relative advantages (grpo, rloo, ...) are 0 for them;
    * ``advantages/abs_mean`` (mean |advantage| over counted tokens) is ≤ ``tol`` at every point;
    * ``policy/grad_norm`` (actor gradient norm before clipping) is ≤ ``tol`` at every point.

    Suggests what to change: for rewards that never differ, check the reward on a few responses
    (``tether eval``), raise ``rollout.temperature`` / ``rollout.n``, or switch on DAPO's dynamic
    sampling ``algo.filter_groups`` (Yu et al. 2025); for a zero gradient with non-zero advantages,
    the actor's trainable parameters.
    """
    found: list[tuple[str, list[int], list[float], str]] = []
    f_steps, f_vals = _series(history, "rollout/zero_var_group_frac")
    f_steps, f_vals = f_steps[-window:], f_vals[-window:]
    flat = len(f_steps) >= min_points and statistics.fmean(f_vals) >= max_flat_frac
    if flat:
        found.append(
            (
                "rollout/zero_var_group_frac",
                f_steps,
                f_vals,
                f"{100 * statistics.fmean(f_vals):.0f}% of prompts got the same reward for all their samples",
            )
        )
    for key, what in (("advantages/abs_mean", "mean |advantage|"), ("policy/grad_norm", "the actor's gradient norm")):
        steps, vals = _series(history, key)
        steps, vals = steps[-window:], vals[-window:]
        if len(steps) >= min_points and max(abs(v) for v in vals) <= tol:
            found.append((key, steps, vals, f"{what} was {_fmt(max(abs(v) for v in vals))} at every step"))
    if not found:
        return []
    metric, steps, values, _ = found[0]
    _, scores = _series(history, "reward/score_mean")
    score_txt = f" (reward/score_mean {_fmt(statistics.median(scores[-window:]))})" if scores else ""
    msg = (
        f"no learning signal over steps {steps[0]}–{steps[-1]}: "
        + "; ".join(w for *_, w in found)
        + score_txt
        + ", so the updates cannot move the policy toward higher reward"
    )
    overrides: tuple[dict[str, Any], ...] = ()
    if flat or metric == "advantages/abs_mean":
        n = _cfg(config, "rollout.n")
        more_n = {"rollout.n": 2 * n} if isinstance(n, int) and n > 0 else {}
        if _cfg(config, "algo.filter_groups") is True:
            fix = (
                f"raise {_now(config, 'algo.filter_groups_max_draws')}",
                _scaled(config, "algo.filter_groups_max_draws", 2),
            )
        elif _cfg(config, "rollout.async_steps"):  # dynamic sampling needs one draw per step: refused with async
            fix = ("", {})
        else:
            fix = (
                "set algo.filter_groups=true (DAPO dynamic sampling: train only on prompts whose samples differ)",
                {"algo.filter_groups": True},
            )
        temperature = _raise_temperature(config)
        texts, overrides = _options(
            (temperature[0].replace("raise ", "", 1), temperature[1]),
            (_now(config, "rollout.n"), more_n),
        )
        texts = [f"raise {' or '.join(texts)} so that samples differ"] if texts else []
        texts, overrides = texts + ([fix[0]] if fix[0] else []), overrides + ((fix[1],) if fix[1] else ())
        suggestion = (
            "check a few responses and their rewards (tether eval MODEL DATA): a reward that never matches the output "
            "format, or a task far too hard or too easy for the model, gives every sample the same score"
            + (f"; {', or '.join(texts)}" if texts else "")
        )
    else:
        suggestion = (
            "the advantages are non-zero but no gradient reaches the weights: check that the actor has trainable "
            "parameters (a LoRA rank above 0, unfrozen weights) and that the loss is not masked out entirely"
        )
    evidence = {
        "steps": steps,
        "values": values,
        "metric": metric,
        "window": window,
        "max_flat_frac": max_flat_frac,
        "tol": tol,
    }
    return [Finding("no_learning_signal", metric, msg, evidence, suggestion, overrides=overrides)]


def _gold_keys(history: History) -> tuple[str, str, bool]:
    """(gold key, training-reward key, exact) of the validations: the noise-free ``exact/*`` of the hackable embedded
    task when logged, else the sampled ``val/*``."""
    if any(_number(r.get("exact/gold_mean")) is not None for r in history):
        return "exact/gold_mean", "exact/score_mean", True
    return "val/gold_mean", "val/score_mean", False


def gold_fall_flags(
    gold: Sequence[float],
    gold_sem: Sequence[float],
    proxy: Sequence[float],
    proxy_sem: Sequence[float],
    *,
    min_rel_drop: float = 0.1,
    z: float = 2.0,
) -> list[int | None]:
    """Per validation i, the index of the best earlier validation the gold fell from (None: no fall), online.

    Validation i has *fallen* when the upper confidence bound of its gold, ``gold[i] + z·gold_sem[i]``, is below the
    best lower bound of the earlier ones, ``B = max_{j<i} gold[j] − z·gold_sem[j]`` (at index j*), by more than
    ``min_rel_drop·|B|``, while the training reward did not fall: ``proxy[i] ≥ proxy[j*] − z·hypot(proxy_sem[j*],
    proxy_sem[i])``. Pure: sequences of equal length (validations in step order), standard errors ≥ 0 (0 for an exact
    gold). Comparing bounds, not means, is what keeps the maximum over many noisy validations from drifting above the
    truth: under a stationary gold with Gaussian errors of known σ, validation i has fallen only if
    ``max_{j<i} gold[j] − gold[i] > 2zσ``, probability at most (i − 1)·Φ(−√2·z) by the union bound (0.23% per earlier
    validation at z = 2); see :func:`check_hacking_gold` for the rate per run.
    """
    n = len(gold)
    if not (len(gold_sem) == len(proxy) == len(proxy_sem) == n):
        raise ValueError("gold, gold_sem, proxy and proxy_sem must have the same length")
    out: list[int | None] = [None] * n
    best = None  # index of the best lower bound so far
    for i in range(n):
        if best is not None:
            lcb = gold[best] - z * gold_sem[best]
            ucb = gold[i] + z * gold_sem[i]
            held = proxy[i] >= proxy[best] - z * math.hypot(proxy_sem[best], proxy_sem[i])
            if lcb - ucb > min_rel_drop * abs(lcb) and held:
                out[i] = best
        if best is None or gold[i] - z * gold_sem[i] > gold[best] - z * gold_sem[best]:
            best = i
    return out


def gold_warn_flags(
    gold: Sequence[float],
    gold_sem: Sequence[float],
    proxy: Sequence[float],
    proxy_sem: Sequence[float],
    *,
    min_rel_drop: float = 0.1,
    z: float = 2.0,
    persist: int = 2,
    sharp_z: float = 5.0,
) -> list[tuple[int, bool] | None]:
    """Per validation i, where the gold check warns, online: ``(j, sharp)`` with j the earlier validation the gold fell
    from, or None.

    Validation i warns when (a) it has fallen (:func:`gold_fall_flags`: its upper bound ``min_rel_drop`` below the best
    earlier lower bound) and so have the ``persist`` − 1 validations before it, or (b) its fall is *sharp*: against the
    earlier validation j with the best lower bound, ``gold[j] − gold[i]`` is at least ``min_rel_drop·|gold[j]|`` and at
    least ``sharp_z·hypot(gold_sem[j], gold_sem[i])``, while the training reward held (as in :func:`gold_fall_flags`).
    (b) asks the means, not the bounds, to differ by ``min_rel_drop``: a 14% fall by 5.6 standard errors warns, where
    the bounds of (a) are only 7% apart. Under a stationary gold with Gaussian errors a given pair is ``sharp_z``
    combined standard errors apart with probability Φ(−sharp_z) (2.9e-7 at 5), so (b) adds at most C(n, 2)·Φ(−sharp_z)
    false alarms per n-validation run. ``sharp_z = inf`` turns (b) off; with standard errors 0 (an exact gold) (b) is
    (a) with ``persist`` = 1. Pure: sequences of equal length. Raises ValueError for unequal lengths or ``persist`` < 1.
    """
    if persist < 1:
        raise ValueError(f"persist must be >= 1, got {persist}")
    flags = gold_fall_flags(gold, gold_sem, proxy, proxy_sem, min_rel_drop=min_rel_drop, z=z)
    out: list[tuple[int, bool] | None] = [None] * len(gold)
    best = None  # index of the best lower bound so far, as in gold_fall_flags
    for i in range(len(gold)):
        if i + 1 >= persist and all(f is not None for f in flags[i + 1 - persist : i + 1]):
            out[i] = (flags[i], False)
        elif best is not None:
            drop = gold[best] - gold[i]
            held = proxy[i] >= proxy[best] - z * math.hypot(proxy_sem[best], proxy_sem[i])
            big = drop > min_rel_drop * abs(gold[best])
            if held and big and drop >= sharp_z * math.hypot(gold_sem[best], gold_sem[i]):
                out[i] = (best, True)
        if best is None or gold[i] - z * gold_sem[i] > gold[best] - z * gold_sem[best]:
            best = i
    return out


def check_hacking_gold(
    history: History,
    *,
    min_rel_drop: float = 0.1,
    z: float = 2.0,
    persist: int = 2,
    sharp_z: float = 5.0,
    config: Any = None,
) -> list[Finding]:
    """Reward hacking seen by a gold reward: the gold score fell while the training (proxy) reward held or rose.

    Reads the validations' gold and training-reward means: ``exact/gold_mean`` and ``exact/score_mean`` (exact, the
    embedded prompts) when logged, else ``val/gold_mean`` and ``val/score_mean`` (``reward.val_function`` /
    ``reward.val_model`` or a built-in gold) with their standard errors ``val/gold_sem`` and ``val/score_sem``; the
    sampled gold's mean and standard error are over the samples it scored (``val/gold_unscored_frac`` the rest: a
    failing gold is not a falling one), and the message names the fraction it could not score. A validation has *fallen*
    (:func:`gold_fall_flags`) when its gold's upper confidence bound (mean + ``z`` standard errors) is more than
    ``min_rel_drop`` below the best lower confidence bound of the earlier validations, while the training reward did not
    fall by more than ``z`` standard errors from its value there. Fires (:func:`gold_warn_flags`) when the last
    validation has fallen and, for a sampled gold, so have the ``persist`` − 1 before it, or its fall is *sharp*: its
    gold's mean is ``min_rel_drop`` and ``sharp_z`` combined standard errors below the earlier validation with the best
    lower bound (an exact gold has no sampling noise: one fall is enough).

    False alarms (``docs/hacking.md``): under a stationary gold with independent sampling noise, the defaults (z = 2,
    persist = 2, sharp_z = 5, 10%) warned in none of 4000 simulated 30-validation runs of 4 prompts × 32 samples,
    against 93.5% for the former rule (means, one fall) (``tests/test_diagnostics_hacking.py``); the sharp path adds
    at most C(30, 2)·Φ(−5) ≈ 1.2e-4 per run (union bound over pairs). Honest runs:
    ``benchmarks/bench_hacking_false_alarms.py``.
    Cost: with a sampled gold, a fall within 5 standard errors is reported ``persist`` validations after it starts.
    The sharp path needs ``val/gold_sem`` at every validation; without it only persistence counts.

    Suggests raising ``kl.coef``, ``guard.on_hacking=rollback``, and fixing the reward's flaw.
    """
    g_key, p_key, exact = _gold_keys(history)
    g_steps, g_vals = _series(history, g_key)
    # val/gold_mean and val/gold_sem are over the samples the gold scored (a failed one is left out, not counted 0), so
    # a validation the gold scored in part is measured, with its standard error, as the guard's rollback measures it;
    # one it scored none of logs no mean and is absent here
    unscored = dict(zip(*_series(history, "val/gold_unscored_frac"), strict=True)) if not exact else {}
    p_by = dict(zip(*_series(history, p_key), strict=True))
    steps = [s for s in g_steps if s in p_by]
    if len(steps) < 2:
        return []
    gold = dict(zip(g_steps, g_vals, strict=True))
    if below := [s for s in steps if gold[s] < 0]:  # the 10% is of a gold whose 0 is the worst: not judged
        msg = (
            f"the gold check cannot judge {g_key}: it went below 0 ({_fmt(gold[below[0]])} at step {below[0]}), and "
            "a fall of the gold is measured relative to 0 as the worst score, so on a shifted scale (correctness − 1, "
            "a log-probability) its 10% means nothing and hacking_gold stays silent"
        )
        evidence = {"steps": steps, "values": [gold[s] for s in steps], "negative_steps": below, "gold_key": g_key}
        suggestion = "make reward.val_function's worst score 0 (a pass rate, correctness: not correctness − 1)"
        return [Finding("hacking_gold", g_key, msg, evidence, suggestion, severity="info")]
    g_sem = dict(zip(*_series(history, "val/gold_sem"), strict=True)) if not exact else {}
    p_sem = dict(zip(*_series(history, "val/score_sem"), strict=True)) if not exact else {}
    need = 1 if exact else max(1, persist)
    warns = gold_warn_flags(
        [gold[s] for s in steps],
        [g_sem.get(s, 0.0) for s in steps],
        [p_by[s] for s in steps],
        [p_sem.get(s, 0.0) for s in steps],
        min_rel_drop=min_rel_drop,
        z=z,
        persist=need,
        # a sharp fall is judged in known standard errors only
        sharp_z=sharp_z if exact or all(s in g_sem for s in steps) else math.inf,
    )
    if warns[-1] is None:
        return []
    j, sharp = warns[-1]
    sharp = sharp and not exact
    last, peak = steps[-1], steps[j]
    drop = gold[peak] - gold[last]
    proxy_change = p_by[last] - p_by[peak]
    se = math.hypot(g_sem.get(peak, 0.0), g_sem.get(last, 0.0))
    sem_txt = "" if exact else f" (standard errors ± {_fmt(g_sem.get(peak, 0.0))}, ± {_fmt(g_sem.get(last, 0.0))})"
    part = [f"{100 * unscored[s]:.0f}% at step {s}" for s in (peak, last) if unscored.get(s, 0.0) > 0]
    if part:  # measured over the scored samples only: if the gold fails on what the policy now writes, say so
        sem_txt += f" (the gold could not score {' and '.join(part)}: measured over the samples it scored)"
    persist_txt = (
        ""
        if need == 1
        else f", a sharp fall of {drop / se:.1f} standard errors"
        if sharp and se > 0
        else ", a sharp fall with no sampling spread"
        if sharp
        else f", fallen at {need} validations in a row"
    )
    msg = (
        f"possible reward hacking: the gold score {g_key} fell from {_fmt(gold[peak])} at step {peak} to "
        f"{_fmt(gold[last])} at step {last}{sem_txt} ({100 * drop / max(abs(gold[peak]), 1e-12):.0f}% down"
        f"{persist_txt}) while the training reward {p_key} went from {_fmt(p_by[peak])} to {_fmt(p_by[last])}: the "
        "policy gains on the reward's flaw, not on the task"
    )
    evidence = {
        "steps": steps,
        "values": [gold[s] for s in steps],
        "proxy_values": [p_by[s] for s in steps],
        "peak_step": peak,
        "drop": drop,
        "proxy_change": proxy_change,
        "gold_key": g_key,
        "proxy_key": p_key,
        "persist": need,
        "sharp": sharp,
        "z": z,
    }
    guard_txt, guard = _hacking_guard(config)
    suggestion = (
        f"{_raise_kl_coef(history, config)}"
        + (
            f", or let the guard act ({guard_txt}: rollback restores the last checkpoint whose gold held and raises β)"
            if guard_txt
            else ""
        )
        + "; fix the training reward's flaw if you can name it"
    )
    overrides = tuple(o for o in (_raise_kl_coef_change(history, config), guard) if o)
    return [Finding("hacking_gold", g_key, msg, evidence, suggestion, overrides=overrides)]


def check_hacking_proxy(
    history: History,
    *,
    window: int = 10,
    lookback: int = 20,
    kl_accel: float = 3.0,
    min_kl_slope: float = 0.005,
    min_len_drift: float = 0.05,
    min_reward_tau: float = 0.0,
    config: Any = None,
) -> list[Finding]:
    """Reward hacking seen without a gold reward: the KL to the reference accelerated and the response length drifted
    while the training reward rose.

    Two signals, both required (either alone is ordinary training), while the training reward (``reward/score_mean``)
    is not falling — Kendall's τ over the last ``2·window`` points above ``min_reward_tau`` (hacking pays; a run whose
    reward falls as its KL jumps is breaking, which other checks report):

    * **KL acceleration** (``kl/ref_mean``): at some point of the last ``lookback`` points, the Theil–Sen slope of the
      ``window`` points before it was at least ``kl_accel`` times the slope of the ``window`` points before those,
      and at least ``min_kl_slope`` nats/token per step: the policy suddenly leaves the reference faster (a new
      behaviour spreading), where ordinary training's KL rises fastest at the start and slows;
    * **length drift** (``response/length_mean``): the median of the last ``window`` points differs from the median of
      the first ``window`` by at least ``min_len_drift`` (a fraction).

    Needs ``2·window + 1`` KL points and ``2·window`` length points. This is tuned on the embedded tasks
    (``docs/hacking.md``: its lag behind the exact onset and its false alarms are measured there); a hack that leaves
    the length alone is not seen by it, and tasks whose length drifts by design need ``min_len_drift`` raised.
    """
    k_steps, k_vals = _series(history, "kl/ref_mean")
    l_steps, l_vals = _series(history, "response/length_mean")
    if len(k_steps) < 2 * window + 1 or len(l_steps) < 2 * window:
        return []
    best = None
    for end in range(max(2 * window, len(k_steps) - lookback), len(k_steps) + 1):
        s_prev = _theil_sen(k_steps[end - 2 * window : end - window], k_vals[end - 2 * window : end - window])[0]
        s_now = _theil_sen(k_steps[end - window : end], k_vals[end - window : end])[0]
        if s_now >= min_kl_slope and s_now >= kl_accel * max(s_prev, 0.0):
            ratio = s_now / s_prev if s_prev > 0 else math.inf
            if best is None or ratio > best[0]:
                best = (ratio, k_steps[end - 1], s_prev, s_now)
    if best is None:
        return []
    early, recent = statistics.median(l_vals[:window]), statistics.median(l_vals[-window:])
    drift = (recent - early) / early if early > 0 else 0.0
    if abs(drift) < min_len_drift:
        return []
    r_steps, r_vals = _series(history, "reward/score_mean")
    r_tau = _kendall_tau(r_steps[-2 * window :], r_vals[-2 * window :]) if len(r_steps) >= 2 else 0.0
    if not r_tau > min_reward_tau:
        return []
    ratio, at, s_prev, s_now = best
    before = f"from {_fmt(s_prev)} before" if s_prev > 0 else "where it was flat before"
    msg = (
        f"possible reward hacking: kl/ref_mean accelerated at step {at} (slope {_fmt(s_now)} nats/token/step over the "
        f"last {window} points, {before}) while "
        f"response/length_mean drifted {100 * drift:+.0f}% (median {_fmt(early)} → {_fmt(recent)} tokens): a new "
        f"behaviour is spreading fast; {_sign_not_proof(history)}"
    )
    evidence = {
        "steps": k_steps[-(2 * window + lookback) :],
        "values": k_vals[-(2 * window + lookback) :],
        "accel_step": at,
        "kl_slope_before": s_prev,
        "kl_slope_after": s_now,
        "length_early": early,
        "length_recent": recent,
        "length_drift": drift,
        "reward_kendall_tau": r_tau,
    }
    gold = _has_gold(history)
    # with a gold the guard acts on hacking_gold alone (trainer.react): suggesting it for this finding would mislead
    guard_txt, guard = ("", {}) if gold else _hacking_guard(config)
    suggestion = f"{_gold_advice(history)}; {_raise_kl_coef(history, config)}" + (
        f"; {guard_txt} acts on this" if guard_txt else ""
    )
    overrides = tuple(o for o in (_raise_kl_coef_change(history, config), guard) if o)
    return [Finding("hacking_proxy", "kl/ref_mean", msg, evidence, suggestion, overrides=overrides)]


def _has_gold(history: History) -> bool:
    """Whether the run logs a gold reward (``exact/gold_mean`` or ``val/gold_mean``)."""
    keys = ("exact/gold_mean", "val/gold_mean")
    return any(_number(r.get(k)) is not None for r in history for k in keys)


def _sign_not_proof(history: History) -> str:
    """The end of a no-gold hacking message: what it is worth, given whether the run has a gold."""
    if _has_gold(history):
        return "a warning sign, not proof; this run logs a gold reward, and hacking_gold, which compares it, decides"
    return "without a gold reward this is a warning sign, not proof"


def _gold_advice(history: History) -> str:
    """The first suggestion of a no-gold hacking finding: add a gold, or read the one the run has."""
    if _has_gold(history):
        return "compare the gold (val/gold_mean or exact/gold_mean) with the training reward: hacking_gold sees a fall"
    return "watch a gold reward beside the training reward (reward.val_function) to tell hacking from learning"


def check_hacking_kl_focus(
    history: History,
    *,
    window: int = 10,
    min_share: float = 0.45,
    min_kl: float = 0.1,
    min_reward_tau: float = 0.0,
    config: Any = None,
) -> list[Finding]:
    """Reward hacking seen without a gold reward and without the length moving: the KL to the reference sits on one
    token id while the training reward rises.

    Fires when the median of the last ``window`` points of ``kl/token_top_share`` (the share of the step's KL carried
    by the token id carrying the most) is at least ``min_share``, the median of the last ``window`` points of
    ``kl/ref_mean`` is at least ``min_kl`` nats/token (below it the share of a near-zero KL is noise), and the
    training reward is not falling (Kendall's τ of ``reward/score_mean`` over the last ``2·window`` points above
    ``min_reward_tau``). A flaw that over-pays one token (a leading digit, a format marker) moves the policy on that
    token; learning a task spreads the KL over what the answer needs.

    Tuned on the tuning half of ``tether.tasks.hacks`` (``docs/hacking.md``: one length-keeping hack and honest runs)
    and reported on the held-out half there. It sees nothing of a flaw whose paid answers differ from the honest ones
    in many tokens (a noisy reward model accepting wrong answers, an answer off by one): there the KL is as spread as
    in honest learning.
    """
    s_steps, s_vals = _series(history, "kl/token_top_share")
    k_steps, k_vals = _series(history, "kl/ref_mean")
    if len(s_vals) < window or len(k_vals) < window:
        return []
    share, kl = statistics.median(s_vals[-window:]), statistics.median(k_vals[-window:])
    if share < min_share or kl < min_kl:
        return []
    r_steps, r_vals = _series(history, "reward/score_mean")
    r_tau = _kendall_tau(r_steps[-2 * window :], r_vals[-2 * window :]) if len(r_steps) >= 2 else 0.0
    if not r_tau > min_reward_tau:
        return []
    msg = (
        f"possible reward hacking: {100 * share:.0f}% of the KL to the reference sits on one token id (median of the "
        f"last {window} points of kl/token_top_share, at kl/ref_mean {_fmt(kl)} nats/token) while the training reward "
        f"rises: the policy is moving on one token, as when a reward over-pays it; {_sign_not_proof(history)}"
    )
    evidence = {
        "steps": s_steps[-window:],
        "values": s_vals[-window:],
        "share_median": share,
        "kl_median": kl,
        "reward_kendall_tau": r_tau,
    }
    # warn-only (not in GUARDED_HACKING_CHECKS): no guard.on_hacking suggestion, which would not act on it
    suggestion = f"{_gold_advice(history)}; {_raise_kl_coef(history, config)}"
    overrides = tuple(o for o in (_raise_kl_coef_change(history, config),) if o)
    return [Finding("hacking_kl_focus", "kl/token_top_share", msg, evidence, suggestion, overrides=overrides)]


def _hacking_guard(config: Any) -> tuple[str, dict[str, Any]]:
    """The guard to suggest for a hacking finding: guard.on_hacking=rollback, with checkpoints to return to where the
    run writes none before its end (trainer.save_freq=0, or at least trainer.total_steps, refuses it); nothing when it
    already rolls back."""
    if _cfg(config, "guard.on_hacking") == "rollback":
        return "", {}
    now = _cfg(config, "guard.on_hacking")
    txt = "guard.on_hacking=rollback" + (f" (now {now})" if now else "")
    change: dict[str, Any] = {"guard.on_hacking": "rollback"}
    save_freq, total = _cfg(config, "trainer.save_freq"), _cfg(config, "trainer.total_steps")
    every = max(1, min(10, (total or 11) - 1))
    if save_freq == 0 or (isinstance(save_freq, int) and isinstance(total, int) and save_freq >= total):
        txt += f" with trainer.save_freq={every} (now {save_freq}: no checkpoint to return to before the end)"
        change["trainer.save_freq"] = every
    if _cfg(config, "trainer.val_freq") == 0:  # rollback chooses its checkpoint by validations (refused without)
        txt += f" and trainer.val_freq={every} (now 0: no validation to choose a checkpoint by)"
        change["trainer.val_freq"] = every
    return txt, change


#: The checks :func:`diagnose` runs, in report order.
CHECKS: dict[str, Callable[..., list[Finding]]] = {
    "kl_rising": check_kl_rising,
    "entropy_collapse": check_entropy_collapse,
    "length_shrinking": check_length_shrinking,
    "reward_flat_kl_growing": check_reward_flat_kl_growing,
    "clipfrac_high": check_clipfrac_high,
    "collapse_rising": check_collapse_rising,
    "no_learning_signal": check_no_learning_signal,
    "hacking_gold": check_hacking_gold,
    "hacking_proxy": check_hacking_proxy,
    "hacking_kl_focus": check_hacking_kl_focus,
}

#: The checks that signal reward hacking (reported as such live and by ``tether doctor``).
HACKING_CHECKS = ("hacking_gold", "hacking_proxy", "hacking_kl_focus")

#: The hacking checks ``guard.on_hacking`` acts on (rollback, stop). ``hacking_kl_focus`` only warns: on the held-out
#: honest runs of docs/hacking.md it warned in 2 of 10, too often to roll a run back on. ``hacking_proxy`` is acted
#: on only in a run without a gold reward (:attr:`LiveDiagnostics.gold_seen`): where the gold is measured its check sees
#: a fall directly, and a proxy warning while the gold holds is a false alarm (docs/hacking.md: held-out ``short_any``,
#: stopped at guard.max_rollbacks by a 5% length drift while its gold held).
GUARDED_HACKING_CHECKS = ("hacking_gold", "hacking_proxy")

#: Every metric some check reads (LiveDiagnostics stores only these).
WATCHED = (
    "kl/ref_mean",
    "kl/coef",
    "policy/entropy",
    "response/length_mean",
    "reward/score_mean",
    "policy/clipfrac",
    "diversity/collapse_rate",
    "rollout/zero_var_group_frac",
    "advantages/abs_mean",
    "policy/grad_norm",
    "exact/gold_mean",
    "exact/score_mean",
    "val/gold_mean",
    "val/score_mean",
    "val/gold_sem",
    "val/score_sem",
    "val/gold_unscored_frac",
    "kl/token_top_share",
)


def _resolve_thresholds(thresholds: Mapping[str, Any]) -> dict[str, dict[str, Any] | None]:
    """Validate ``{check: {param: value}}`` (``False``/``None`` disables a check)."""
    out: dict[str, dict[str, Any] | None] = {name: {} for name in CHECKS}
    for name, params in thresholds.items():
        if name not in CHECKS:
            raise ValueError(f"unknown check {name!r}; valid: {', '.join(CHECKS)}")
        if params is False or params is None:
            out[name] = None
            continue
        if not isinstance(params, Mapping):
            raise TypeError(f"thresholds for {name!r} must be a dict of keyword arguments or False, got {params!r}")
        sig = inspect.signature(CHECKS[name]).parameters
        for p in params:
            if p not in sig or p in ("history", "config"):
                valid = [k for k in sig if k not in ("history", "config")]
                raise ValueError(f"unknown threshold {name}.{p}; valid: {', '.join(valid)}")
        out[name] = dict(params)
    return out


def diagnose(history: History, *, config: Any = None, **thresholds: Any) -> list[Finding]:
    """Run every check over ``history``; findings in :data:`CHECKS` order (empty list = healthy).

    Args:
        history: one dict per logged step with an integer ``"step"`` (see the module docstring).
        config: optional resolved run config (nested mapping such as ``config.yaml`` loaded, or a
            ``TetherConfig``); used only to quote current values in suggestions.
        **thresholds: per check, a dict of keyword thresholds, or ``False`` to skip it, e.g.
            ``diagnose(h, kl_rising={"floor": 0.1}, clipfrac_high=False)``.

    Raises:
        ValueError: an unknown check or threshold name.
    """
    resolved = _resolve_thresholds(thresholds)
    findings: list[Finding] = []
    for name, fn in CHECKS.items():
        params = resolved[name]
        if params is not None:
            findings.extend(fn(history, config=config, **params))
    return findings


# --------------------------------------------------------------------------------------------------
# reading a run directory
# --------------------------------------------------------------------------------------------------
def _metrics_path(run_dir: str | Path) -> Path:
    p = Path(run_dir)
    return p if p.is_file() else p / METRICS_FILE


def _read_records(path: Path) -> tuple[list[dict], list[Finding]]:
    """Parse ``metrics.jsonl``; unreadable lines are skipped and returned as findings."""
    with open(path, encoding="utf-8", errors="replace", newline="") as f:
        text = f.read()
    lines = text.split("\n")
    complete_last = text.endswith("\n")
    if complete_last:
        lines.pop()  # the empty string after the final newline
    records: list[dict] = []
    problems: list[Finding] = []
    for i, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        is_last = i == len(lines)
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            rec, err = None, str(e)
        else:
            err = None
            if not isinstance(rec, dict):
                err = f"not a JSON object but {type(rec).__name__}"
            elif isinstance(rec.get("step"), bool) or not isinstance(rec.get("step"), int):
                err = 'no integer "step"'
        if err is None:
            records.append(rec)
            continue
        excerpt = line[:60] + ("…" if len(line) > 60 else "")
        if is_last and not complete_last:
            problems.append(
                Finding(
                    "metrics_file",
                    METRICS_FILE,
                    f"{path}: the last line ({i}, {len(line)} characters, no final newline) is truncated and was "
                    "ignored, as when a run is stopped mid-write",
                    {"path": str(path), "line": i, "excerpt": excerpt, "error": err},
                    "nothing to change if the run was killed or is still writing",
                    "info",
                )
            )
        else:
            problems.append(
                Finding(
                    "metrics_file",
                    METRICS_FILE,
                    f"{path}: line {i} is malformed ({err}) and was ignored",
                    {"path": str(path), "line": i, "excerpt": excerpt, "error": err},
                    "check what else writes to this file; the records of that step are lost",
                    "warning",
                )
            )
    return records, problems


def read_metrics(run_dir: str | Path) -> list[dict]:
    """Read the per-step records of a run: ``RUN_DIR/metrics.jsonl`` (or a ``.jsonl`` file path).

    Blank lines are skipped. A truncated last line (no final newline, not valid JSON: the writer
    was interrupted) is tolerated: it is dropped and reported as a warning on the ``tether`` logger.
    A malformed line elsewhere (invalid JSON, not an object, or no integer ``"step"``) is dropped
    and reported the same way. Records are returned in file order, unmodified (duplicate steps of a
    resumed run included; the checks deduplicate).

    Raises:
        FileNotFoundError: the directory or its ``metrics.jsonl`` does not exist (message names the path).
        OSError: the file cannot be read.
    """
    path = _metrics_path(run_dir)
    if not path.exists():
        raise FileNotFoundError(f"no {METRICS_FILE} at {path}")
    records, problems = _read_records(path)
    for p in problems:
        log.warning("%s", p.message)
    return records


def load_run_config(run_dir: Path) -> Any:
    """A run directory's ``config.yaml`` as a mapping (it only decorates the doctor's suggestions with current values);
    None when missing or unreadable."""
    p = run_dir / CONFIG_FILE
    if not p.is_file():
        return None
    try:
        import yaml

        cfg = yaml.safe_load(p.read_text(encoding="utf-8"))
    except Exception:  # the config only decorates suggestions
        return None
    return cfg if isinstance(cfg, Mapping) else None


def _evidence_line(ev: Mapping[str, Any]) -> str:
    steps, values = ev.get("steps"), ev.get("values")
    if not steps or not values:
        return ", ".join(f"{k}={_fmt(v)}" for k, v in ev.items())
    pairs = [f"{s}: {_fmt(v)}" for s, v in zip(steps, values, strict=True)]
    if len(pairs) > 10:
        pairs = pairs[:4] + [f"… ({len(pairs) - 8} more)"] + pairs[-4:]
    return "step " + ", ".join(pairs)


def format_findings(findings: Sequence[Finding]) -> str:
    """The human-readable block ``doctor`` prints for ``findings`` (no trailing newline)."""
    out = []
    for f in findings:
        out.append(f"[{f.severity}] {f.check} ({f.metric})")
        out.append(f"  {f.message}")
        if f.check != "metrics_file":
            out.append(f"  evidence: {_evidence_line(f.evidence)}")
        out.append(f"  suggestion: {f.suggestion}")
    return "\n".join(out)


def doctor(run_dir: str | Path, *, out: TextIO | None = None, **thresholds: Any) -> int:
    """Check a run directory's health and print a report; returns the exit code for ``tether doctor``.

    Reads ``RUN_DIR/metrics.jsonl`` (and ``RUN_DIR/config.yaml`` if present, to quote current
    config values in suggestions), runs :func:`diagnose`, and prints each finding with its
    evidence and suggestion, then a summary line; with no finding it prints a line starting
    ``healthy:``.

    Args:
        run_dir: the run directory (or its ``metrics.jsonl`` directly).
        out: where to print; default stdout for the report and stderr for the exit-2 message.
        **thresholds: per-check thresholds, as for :func:`diagnose`.

    Returns:
        0 healthy or info findings only; 1 at least one warning; 2 the run directory or its
        ``metrics.jsonl`` cannot be read or holds no record (the message names the path).

    Raises:
        ValueError: an unknown check or threshold name.
    """
    err = out if out is not None else sys.stderr
    out = out if out is not None else sys.stdout
    path = _metrics_path(run_dir)
    try:
        if not path.exists():
            raise FileNotFoundError(f"no {METRICS_FILE} at {path}")
        records, problems = _read_records(path)
    except OSError as e:
        print(f"tether doctor: cannot read run directory {run_dir}: {e}", file=err)
        return 2
    if not records:
        print(f"tether doctor: no metric records in {path}", file=err)
        return 2
    config = load_run_config(path.parent)
    now = diagnose(records, config=config, **thresholds)
    earlier = cleared_findings(records, now, config=config, **thresholds)
    findings = problems + now + earlier
    steps = sorted({r["step"] for r in records})
    print(f"tether doctor: {path.parent} ({len(steps)} steps, {steps[0]}–{steps[-1]})", file=out)
    if findings:
        print(format_findings(findings), file=out)
    n_warn = sum(f.severity == "warning" for f in findings)
    n_info = len(findings) - n_warn
    if n_warn:
        print(f"{n_warn} warning(s), {n_info} info", file=out)
        return 1
    n_other = n_info - len(earlier)
    extra = f" ({n_other} info)" if n_other else ""
    cleared = f"; {len(earlier)} finding(s) reported during training have cleared (above)" if earlier else ""
    print(f"healthy: no check fired ({', '.join(CHECKS)}){extra}{cleared}", file=out)
    return 0


def cleared_findings(
    history: History, current: Sequence[Finding], *, config: Any = None, every: int | None = None, **thresholds: Any
) -> list[Finding]:
    """Findings the trainer's live checks reported during the run that no longer fire at its end.

    Replays :class:`LiveDiagnostics` over ``history`` on the trainer's schedule (every
    :data:`LIVE_EVERY` steps from step 1, the records deduplicated by step as the checks do), so
    ``tether doctor`` shows every warning the run printed: a KL that rose early and then levelled
    off was reported live at that step and is absent from the last window. Each comes back once
    per (check, metric), as ``info``, with the step it was last reported and its evidence then.

    Args:
        history: the run's records; current: the findings of :func:`diagnose` on all of it.
        every: evaluation period (default :data:`LIVE_EVERY`).
    """
    live = LiveDiagnostics(every or LIVE_EVERY, config=config, **thresholds)
    by_step = {r["step"]: r for r in history if isinstance(r.get("step"), int) and not isinstance(r.get("step"), bool)}
    reported: dict[tuple[str, str], tuple[int, int, Finding]] = {}
    for step in sorted(s for s in by_step if s >= 1):  # step 0 is the reference's validation, never fed live
        for f in live.update(step, by_step[step]):
            first = reported.get((f.check, f.metric), (step, 0, f))[0]
            reported[(f.check, f.metric)] = (first, step, f)
    active = {(f.check, f.metric) for f in current}
    last = max(by_step) if by_step else 0
    out = []
    for key, (first, step, f) in reported.items():
        if key in active:
            continue
        when = f"step {step}" if first == step else f"steps {first} and {step} (first and last report)"
        msg = f"reported during training at {when}, no longer firing at step {last}: {f.message}"
        out.append(Finding(f.check, f.metric, msg, f.evidence, f.suggestion, "info", f.overrides))
    return out


# --------------------------------------------------------------------------------------------------
# live
# --------------------------------------------------------------------------------------------------
LIVE_EVERY = 10
"""The trainer evaluates its live checks every this many steps (``tether doctor`` replays the same schedule)."""


class LiveDiagnostics:
    """The same checks during training: call :meth:`update` every step, log what it returns.

    Runs :func:`diagnose` on every ``every``-th call of :meth:`update` and returns only new
    findings: a (check, metric) pair is reported once, then stays silent while it keeps firing,
    and is reported again only after it has cleared (not fired at one evaluation) and fires anew.

    Memory and time are bounded: per watched metric it keeps the first and the last ``K`` points,
    with ``K`` the largest window any check uses (20 by default), which gives the checks exactly
    the points they read; one evaluation costs O(K²) arithmetic (the Theil–Sen slope), about
    0.3 ms with the default thresholds.

    Args:
        every: evaluate every ``every`` calls (>= 1).
        config: optional run config, to quote current values in suggestions (see :func:`diagnose`).
        **thresholds: per-check thresholds as for :func:`diagnose`.

    Raises:
        ValueError: ``every < 1``, or an unknown check/threshold name.
    """

    def __init__(self, every: int = LIVE_EVERY, *, config: Any = None, **thresholds: Any):
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.every = every
        self.config = config
        self._thresholds = thresholds
        resolved = _resolve_thresholds(thresholds)
        keep = 1
        for name, fn in CHECKS.items():
            defaults = {k: p.default for k, p in inspect.signature(fn).parameters.items()}
            defaults.update(resolved[name] or {})
            keep = max([keep] + [v for k, v in defaults.items() if k != "config" and isinstance(v, int)])
            if name == "hacking_proxy":  # two windows before each of the last `lookback` points
                keep = max(keep, 2 * defaults["window"] + defaults["lookback"])
        self._keep = keep
        self._head: dict[str, list[tuple[int, float]]] = {k: [] for k in WATCHED}
        self._tail: dict[str, list[tuple[int, float]]] = {k: [] for k in WATCHED}
        self._calls = 0
        self._active: set[tuple[str, str]] = set()

    def _add(self, key: str, step: int, value: float) -> None:
        head, tail = self._head[key], self._tail[key]
        # a step at or before the last one stored (re-logged or rewound): forget the newer points
        for buf in (tail, head):
            while buf and buf[-1][0] >= step:
                buf.pop()
        if len(head) < self._keep and not tail:
            head.append((step, value))
        else:
            tail.append((step, value))
            if len(tail) > self._keep:
                del tail[0]

    def state_dict(self) -> dict:
        """What a checkpoint keeps (its history comes back from metrics.jsonl by :meth:`load`): ``calls`` (the
        evaluation counter) and ``active`` (the (check, metric) pairs firing at the last evaluation, as lists)."""
        return {"calls": self._calls, "active": sorted([list(a) for a in self._active])}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s counter and firing findings."""
        self._calls = int(state["calls"])
        self._active = {tuple(a) for a in state["active"]}

    def load(self, history: History) -> None:
        """Feed past records (e.g. :func:`read_metrics` of a resumed run) without evaluating, step 0 (the reference's
        validation, which the live run passes to :meth:`observe`) included,
        so a resumed run sees what the uninterrupted one saw."""
        for rec in sorted(
            (r for r in history if isinstance(r.get("step"), int) and r["step"] >= 0), key=lambda r: r["step"]
        ):
            self._store(rec["step"], rec)

    def _store(self, step: int, metrics: Mapping[str, Any]) -> None:
        for key in WATCHED:
            v = _number(metrics.get(key))
            if v is not None:
                self._add(key, step, v)

    def history(self) -> list[dict]:
        """The compact history the checks see (first and last ``K`` points of each watched metric)."""
        by_step: dict[int, dict] = {}
        for key in WATCHED:
            for s, v in self._head[key] + self._tail[key]:
                by_step.setdefault(s, {"step": s})[key] = v
        return [by_step[s] for s in sorted(by_step)]

    def forget_findings(self) -> None:
        """The run was rolled back to a checkpoint (a guard): what fires from now on is a new event, reported (and
        acted on) again at the next evaluation, not kept silent as "still firing" since before the rollback. The
        points stay (a replay of metrics.jsonl sees them too)."""
        self._active.clear()

    @property
    def gold_seen(self) -> bool:
        """A gold reward was logged (``exact/gold_mean`` or ``val/gold_mean`` at some validation): the run has the
        gold check, and ``guard.on_hacking`` acts on it alone (:data:`GUARDED_HACKING_CHECKS`)."""
        return any(self._head[k] or self._tail[k] for k in ("exact/gold_mean", "val/gold_mean"))

    def observe(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Record metrics without a check or a call on the schedule: the step-0 validation (the reference's scores),
        which the gold check needs as its first best, as a replay of metrics.jsonl (``tether doctor``) sees it."""
        self._store(int(step), metrics)

    def update(self, step: int, metrics: Mapping[str, Any]) -> list[Finding]:
        """Record one step's metrics; on every ``every``-th call, return the newly firing findings."""
        self._store(int(step), metrics)
        self._calls += 1
        if self._calls % self.every:
            return []
        found = diagnose(self.history(), config=self.config, **self._thresholds)
        new = [f for f in found if (f.check, f.metric) not in self._active]
        self._active = {(f.check, f.metric) for f in found}
        return new
