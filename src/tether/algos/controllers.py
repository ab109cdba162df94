"""KL coefficient (β) controllers.

Every controller holds β (``.value``, a Python float) and moves it in ``update(current_kl,
n_steps)``. The trainer calls ``update`` once per training step with

* ``current_kl``: the logged ``kl/ref_mean`` — the masked per-token mean KL of each response,
  averaged over responses, in **nats per token** (:func:`tether.algos.mean_kl_per_token`);
* ``n_steps``: the number of responses (episodes) in the batch.

All targets and thresholds below are therefore in nats per token, the unit of the logged KL, so a
target written in the same unit as the plot means what it says. TRL's adaptive controller uses the
per-sequence KL summed over tokens (its default target 6 is nats per sequence); verl uses the
per-token mean, as tether does. Convert a per-sequence target by dividing by the typical response
length.

All controllers accept optional bounds ``beta_min``/``beta_max``; β is clamped into them after
every update. ``state_dict()`` is JSON-serialisable and round-trips exactly (Python floats survive
``json`` unchanged), so a resumed run continues with the same β.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = [
    "KLController",
    "FixedKLController",
    "AdaptiveKLController",
    "BandKLController",
    "ExponentialKLController",
    "ScheduledKLController",
    "KL_CONTROLLERS",
    "make_kl_controller",
    "EntropyCoefController",
]


def _finite(name: str, value: Any) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name} must be a real number, got {value!r}") from exc
    if not math.isfinite(v):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return v


def _positive(name: str, value: Any) -> float:
    v = _finite(name, value)
    if v <= 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    return v


class KLController:
    """Base class: holds β, the bounds and the number of updates done.

    Args:
        coef: initial β ≥ 0.
        beta_min, beta_max: optional bounds (≥ 0, ``beta_min ≤ beta_max``); ``coef`` must lie
            inside them.

    Raises:
        ValueError: naming the offending argument.
    """

    name = "base"
    _coef_must_be_in_bounds = True

    def __init__(self, coef: float, *, beta_min: float | None = None, beta_max: float | None = None):
        coef = _finite("coef", coef)
        if coef < 0:
            raise ValueError(f"coef (beta) must be >= 0, got {coef!r}")
        self.beta_min = None if beta_min is None else _finite("beta_min", beta_min)
        self.beta_max = None if beta_max is None else _finite("beta_max", beta_max)
        if self.beta_min is not None and self.beta_min < 0:
            raise ValueError(f"beta_min must be >= 0, got {beta_min!r}")
        if self.beta_max is not None and self.beta_max < 0:
            raise ValueError(f"beta_max must be >= 0, got {beta_max!r}")
        if self.beta_min is not None and self.beta_max is not None and self.beta_min > self.beta_max:
            raise ValueError(f"beta_min ({beta_min!r}) must be <= beta_max ({beta_max!r})")
        if self._coef_must_be_in_bounds and self._clamp(coef) != coef:
            raise ValueError(f"coef ({coef!r}) must lie within [beta_min, beta_max] = [{beta_min!r}, {beta_max!r}]")
        self._value = coef
        self.n_updates = 0

    @property
    def value(self) -> float:
        """Current β (dimensionless multiplier of a KL in nats)."""
        return self._value

    def _clamp(self, beta: float) -> float:
        if self.beta_min is not None:
            beta = max(beta, self.beta_min)
        if self.beta_max is not None:
            beta = min(beta, self.beta_max)
        return beta

    @staticmethod
    def _check_update(current_kl: Any, n_steps: Any) -> tuple[float, int]:
        kl = _finite("current_kl", current_kl)
        if isinstance(n_steps, bool) or int(n_steps) != n_steps or n_steps < 0:
            raise ValueError(f"n_steps must be an integer >= 0, got {n_steps!r}")
        return kl, int(n_steps)

    def update(self, current_kl: float, n_steps: int = 1) -> float:
        """Move β given the observed KL (nats per token); returns the new β.

        Raises:
            ValueError: ``current_kl`` is not finite, or ``n_steps`` is not an integer ≥ 0.
        """
        kl, n = self._check_update(current_kl, n_steps)
        self._value = self._clamp(self._next(kl, n))
        self.n_updates += 1
        return self._value

    def _next(self, kl: float, n_steps: int) -> float:  # pragma: no cover - overridden
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state: ``{"name", "value", "n_updates"}``."""
        return {"name": self.name, "value": self._value, "n_updates": self.n_updates}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore β and the update count saved by :meth:`state_dict`.

        The hyper-parameters come from the constructor (the resumed run's config), not from
        ``state``.

        Raises:
            ValueError: ``state`` belongs to another controller type or is malformed.
        """
        if state.get("name") != self.name:
            raise ValueError(f"state_dict is for controller {state.get('name')!r}, not {self.name!r}")
        value = _finite("state['value']", state["value"])
        if value < 0:
            raise ValueError(f"state['value'] must be >= 0, got {value!r}")
        n = state.get("n_updates", 0)
        if isinstance(n, bool) or int(n) != n or n < 0:
            raise ValueError(f"state['n_updates'] must be an integer >= 0, got {n!r}")
        self._value = value
        self.n_updates = int(n)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(value={self._value!r}, n_updates={self.n_updates})"


class FixedKLController(KLController):
    """β stays at ``coef`` (verl's ``kl_ctrl.type=fixed``; TRL's ``FixedKLController``)."""

    name = "fixed"

    def _next(self, kl: float, n_steps: int) -> float:
        return self._value


class AdaptiveKLController(KLController):
    """Proportional controller of Ziegler et al. 2019 (sec. 2.2), as in TRL and verl.

    ``e = clip(KL / target - 1, -clip, clip)``, ``β ← β · (1 + e · n_steps / horizon)``.

    Args:
        coef: initial β > 0 (a multiplicative rule cannot leave 0).
        target: target KL in **nats per token** (default 0.1, verl's ``target_kl``).
        horizon: number of *responses* (episodes) over which the error is corrected (default
            10000, Ziegler et al./TRL/verl); ``n_steps`` counts responses in the batch.
        clip: bound on the proportional error (0.2 in the paper).
        beta_min, beta_max: optional bounds.

    Raises:
        ValueError: target ≤ 0, horizon ≤ 0, clip ≤ 0, coef ≤ 0, bad bounds; in ``update`` also
            when ``n_steps · clip ≥ horizon`` (a multiplier ≤ 0 would flip β's sign).
    """

    name = "adaptive"

    def __init__(
        self,
        coef: float,
        target: float = 0.1,
        horizon: float = 10000,
        *,
        clip: float = 0.2,
        beta_min: float | None = None,
        beta_max: float | None = None,
    ):
        super().__init__(coef, beta_min=beta_min, beta_max=beta_max)
        if self._value <= 0:
            raise ValueError(f"coef must be > 0 for the adaptive controller, got {coef!r}")
        self.target = _positive("target", target)
        self.horizon = _positive("horizon", horizon)
        self.clip = _positive("clip", clip)

    def _next(self, kl: float, n_steps: int) -> float:
        if n_steps * self.clip >= self.horizon:
            raise ValueError(
                f"n_steps ({n_steps}) times clip ({self.clip}) must be < horizon ({self.horizon}); otherwise one "
                "update could make beta <= 0 — raise horizon"
            )
        error = min(max(kl / self.target - 1.0, -self.clip), self.clip)
        return self._value * (1.0 + error * n_steps / self.horizon)


class BandKLController(KLController):
    """Band rule: ``β ← β·up`` if KL > high, ``β ← β·down`` if KL < low, else unchanged.

    A rule practitioners use (a dead-band bang-bang controller); one step per ``update`` call,
    ``n_steps`` is ignored.

    Args:
        coef: initial β > 0.
        high, low: band edges in nats per token (defaults 0.1 and 0.01), ``0 ≤ low < high``.
        up: multiplier > 1 when KL is too high (default 1.2).
        down: multiplier in (0, 1) when KL is too low (default 0.8).

    Raises:
        ValueError: low < 0, low ≥ high, up ≤ 1, down ≥ 1 or down ≤ 0, coef ≤ 0, bad bounds.
    """

    name = "band"

    def __init__(
        self,
        coef: float,
        high: float = 0.1,
        low: float = 0.01,
        up: float = 1.2,
        down: float = 0.8,
        *,
        beta_min: float | None = None,
        beta_max: float | None = None,
    ):
        super().__init__(coef, beta_min=beta_min, beta_max=beta_max)
        if self._value <= 0:
            raise ValueError(f"coef must be > 0 for the band controller, got {coef!r}")
        self.high = _finite("high", high)
        self.low = _finite("low", low)
        if self.low < 0:
            raise ValueError(f"low must be >= 0, got {low!r}")
        if not self.low < self.high:
            raise ValueError(f"low ({low!r}) must be < high ({high!r})")
        self.up = _finite("up", up)
        if self.up <= 1:
            raise ValueError(f"up must be > 1, got {up!r}")
        self.down = _finite("down", down)
        if not 0 < self.down < 1:
            raise ValueError(f"down must be in (0, 1), got {down!r}")

    def _next(self, kl: float, n_steps: int) -> float:
        if kl > self.high:
            return self._value * self.up
        if kl < self.low:
            return self._value * self.down
        return self._value


class ExponentialKLController(KLController):
    """Log-space dual ascent on β: ``β ← β · exp(lr · (KL - target) / target)``.

    The Lagrangian of max E[r] s.t. KL ≤ target has dual variable β; a gradient step on log β
    with the relative constraint violation keeps β > 0. One step per ``update`` call;
    ``n_steps`` is ignored.

    Args:
        coef: initial β > 0.
        target: target KL in nats per token (default 0.1).
        lr: learning rate of the log-β step (default 0.1).
        max_log_step: optional bound on |lr · (KL - target) / target| per update (a visible
            guard against one outlier batch; default None = no bound). Independently, log β is
            capped at 700 so β never overflows to inf.

    Raises:
        ValueError: target ≤ 0, lr ≤ 0, max_log_step ≤ 0, coef ≤ 0, bad bounds.
    """

    name = "exponential"

    def __init__(
        self,
        coef: float,
        target: float = 0.1,
        lr: float = 0.1,
        *,
        max_log_step: float | None = None,
        beta_min: float | None = None,
        beta_max: float | None = None,
    ):
        super().__init__(coef, beta_min=beta_min, beta_max=beta_max)
        if self._value <= 0:
            raise ValueError(f"coef must be > 0 for the exponential controller, got {coef!r}")
        self.target = _positive("target", target)
        self.lr = _positive("lr", lr)
        self.max_log_step = None if max_log_step is None else _positive("max_log_step", max_log_step)

    def _next(self, kl: float, n_steps: int) -> float:
        step = self.lr * (kl - self.target) / self.target
        if self.max_log_step is not None:
            step = min(max(step, -self.max_log_step), self.max_log_step)
        return math.exp(min(math.log(self._value) + step, 700.0))


class ScheduledKLController(KLController):
    """β as a function of the training step, ignoring the observed KL.

    The step is the number of ``update`` calls made so far (the trainer calls ``update`` once per
    training step); ``n_steps`` (responses in the batch) is deliberately *not* used, so the
    schedule is the same whatever the batch size. ``current_kl`` is still checked to be finite.
    After k updates, β = schedule(k); at construction β = schedule(0).

    Kinds:
        * ``"piecewise"``: ``stages = [[num_steps, beta], ...]``; the first stage lasts
          ``num_steps`` updates, then the next, ...; the last stage holds forever (its num_steps
          may be 0). The stages define β from step 0 on: ``coef`` is not used by this kind.
        * ``"linear"``: ``coef + (final_coef - coef) · min(k, total_steps) / total_steps``.
        * ``"cosine"``: ``final_coef + (coef - final_coef) · ½(1 + cos(π · min(k, total_steps) /
          total_steps))``.

    The bounds clamp the scheduled value (β_min ≤ schedule(k) ≤ β_max is not required).

    Raises:
        ValueError: unknown kind, missing/ill-formed ``stages`` (num_steps integers ≥ 1, the last
            ≥ 0; betas ≥ 0), ``final_coef`` < 0 or missing, ``total_steps`` < 1 or missing, a
            negative ``coef``, bad bounds.
    """

    name = "scheduled"
    _coef_must_be_in_bounds = False  # the bounds clamp the schedule instead
    KINDS = ("piecewise", "linear", "cosine")

    def __init__(
        self,
        coef: float,
        kind: str = "piecewise",
        *,
        stages: list[list[float]] | None = None,
        final_coef: float | None = None,
        total_steps: int | None = None,
        beta_min: float | None = None,
        beta_max: float | None = None,
    ):
        if kind not in self.KINDS:
            raise ValueError(f"kind must be one of {', '.join(self.KINDS)}, got {kind!r}")
        self.kind = kind
        self.stages: list[tuple[int, float]] | None = None
        self.final_coef: float | None = None
        self.total_steps: int | None = None
        if kind == "piecewise":
            if not stages:
                raise ValueError("stages must be a non-empty list of [num_steps, beta] for kind='piecewise'")
            parsed = []
            for i, stage in enumerate(stages):
                if len(stage) != 2:
                    raise ValueError(f"stages[{i}] must be [num_steps, beta], got {stage!r}")
                n, b = stage
                last = i == len(stages) - 1
                if isinstance(n, bool) or int(n) != n or n < (0 if last else 1):
                    raise ValueError(f"stages[{i}] num_steps must be an integer >= {0 if last else 1}, got {n!r}")
                b = _finite(f"stages[{i}] beta", b)
                if b < 0:
                    raise ValueError(f"stages[{i}] beta must be >= 0, got {b!r}")
                parsed.append((int(n), b))
            self.stages = parsed
        else:
            if final_coef is None:
                raise ValueError(f"final_coef is required for kind={kind!r}")
            self.final_coef = _finite("final_coef", final_coef)
            if self.final_coef < 0:
                raise ValueError(f"final_coef must be >= 0, got {final_coef!r}")
            if (
                total_steps is None
                or isinstance(total_steps, bool)
                or int(total_steps) != total_steps
                or total_steps < 1
            ):
                raise ValueError(f"total_steps must be an integer >= 1 for kind={kind!r}, got {total_steps!r}")
            self.total_steps = int(total_steps)
        super().__init__(coef, beta_min=beta_min, beta_max=beta_max)
        self.coef = self._value
        self._value = self._clamp(self.schedule(0))

    def schedule(self, step: int) -> float:
        """β after ``step`` updates, before the bounds are applied."""
        if self.kind == "piecewise":
            assert self.stages is not None
            end = 0
            for n, beta in self.stages:
                end += n
                if step < end:
                    return beta
            return self.stages[-1][1]
        assert self.total_steps is not None and self.final_coef is not None
        frac = min(step, self.total_steps) / self.total_steps
        if self.kind == "linear":
            return self.coef + (self.final_coef - self.coef) * frac
        return self.final_coef + (self.coef - self.final_coef) * 0.5 * (1.0 + math.cos(math.pi * frac))

    def _next(self, kl: float, n_steps: int) -> float:
        return self.schedule(self.n_updates + 1)


KL_CONTROLLERS: tuple[str, ...] = ("fixed", "adaptive", "band", "exponential", "scheduled")
"""Names accepted by :func:`make_kl_controller`."""

_CONTROLLER_CLASSES: dict[str, type[KLController]] = {
    "fixed": FixedKLController,
    "adaptive": AdaptiveKLController,
    "band": BandKLController,
    "exponential": ExponentialKLController,
    "scheduled": ScheduledKLController,
}


def make_kl_controller(name: str, coef: float, **kwargs: Any) -> KLController:
    """Build a controller from its config name and keyword arguments.

    Args:
        name: one of :data:`KL_CONTROLLERS`.
        coef: initial β.
        **kwargs: the controller's own keyword arguments (e.g. ``target``, ``horizon``,
            ``beta_min``); an unknown keyword raises.

    Raises:
        ValueError: unknown name (lists the valid names) or an argument the controller does
            not take / rejects.
    """
    if name not in _CONTROLLER_CLASSES:
        raise ValueError(f"unknown KL controller {name!r}; valid names: {', '.join(KL_CONTROLLERS)}")
    try:
        return _CONTROLLER_CLASSES[name](coef, **kwargs)
    except TypeError as exc:
        raise ValueError(f"bad arguments for KL controller {name!r}: {exc}") from exc


class EntropyCoefController:
    """The entropy bonus's coefficient α, held at a target entropy by projected dual ascent.

    The constrained problem max_θ J(θ) s.t. H(π_θ) ≥ H_target has the Lagrangian
    J(θ) + α·(H(π_θ) − H_target) with α ≥ 0: the actor ascends it in θ (the entropy bonus α·H in its
    loss), and α takes a projected (sub)gradient step on the dual, once per training step:

        α ← clip(α + lr · (H_target − H), 0, α_max)

    so α grows while the policy's entropy is below the target and shrinks back to 0 above it (the
    same dual variable as SAC's automatic entropy tuning, Haarnoja et al. 2018 sec. 5, there on
    log α; here on α itself, so that α can reach and stay at 0, where the bonus is off). α_max bounds
    the bonus so that a target the policy cannot reach does not let it grow without limit.

    Units: H and H_target in **nats per token**. The trainer passes H = ``policy/entropy``: the
    entropy of π_old at each sampled position, averaged over each counted response's tokens and
    then over responses (the quantity it logs, as the KL controllers get ``kl/ref_mean``). α is
    dimensionless (it multiplies an entropy in nats, as β a KL); ``lr`` is α per nat per step.

    Args:
        coef: initial α, in [0, coef_max].
        target: H_target ≥ 0, nats per token.
        lr: step size > 0.
        coef_max: upper bound α_max > 0.

    ``state_dict()`` is JSON-serialisable (``{"name", "value", "n_updates"}``) and round-trips
    exactly, so a resumed run continues with the same α; hyper-parameters come from the
    constructor.

    Raises:
        ValueError: naming the offending argument.
    """

    name = "entropy_dual_ascent"

    def __init__(self, coef: float, *, target: float, lr: float, coef_max: float):
        self.target = _finite("target", target)
        if self.target < 0:
            raise ValueError(f"target (entropy, nats per token) must be >= 0, got {target!r}")
        self.lr = _positive("lr", lr)
        self.coef_max = _positive("coef_max", coef_max)
        coef = _finite("coef", coef)
        if not 0 <= coef <= self.coef_max:
            raise ValueError(f"coef ({coef!r}) must lie within [0, coef_max] = [0, {coef_max!r}]")
        self._value = coef
        self.n_updates = 0

    @property
    def value(self) -> float:
        """Current α (dimensionless)."""
        return self._value

    def update(self, entropy: float) -> float:
        """One dual step given the observed entropy H (nats per token); returns the new α.

        Raises:
            ValueError: ``entropy`` is not finite.
        """
        h = _finite("entropy", entropy)
        self._value = min(max(self._value + self.lr * (self.target - h), 0.0), self.coef_max)
        self.n_updates += 1
        return self._value

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state: ``{"name", "value", "n_updates"}``."""
        return {"name": self.name, "value": self._value, "n_updates": self.n_updates}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore α and the update count saved by :meth:`state_dict`; an α above this controller's
        ``coef_max`` (a resumed run that lowered the bound) is clamped to it.

        Raises:
            ValueError: ``state`` is another controller's, or malformed (a negative or non-finite α).
        """
        if state.get("name") != self.name:
            raise ValueError(f"state_dict is for controller {state.get('name')!r}, not {self.name!r}")
        value = _finite("state['value']", state["value"])
        if value < 0:
            raise ValueError(f"state['value'] must be >= 0, got {value!r}")
        value = min(value, self.coef_max)
        n = state.get("n_updates", 0)
        if isinstance(n, bool) or int(n) != n or n < 0:
            raise ValueError(f"state['n_updates'] must be an integer >= 0, got {n!r}")
        self._value = value
        self.n_updates = int(n)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(value={self._value!r}, n_updates={self.n_updates})"
