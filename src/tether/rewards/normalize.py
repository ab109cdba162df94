"""Reward clipping and normalisation: per-batch whitening and a running mean / std (Welford)."""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["NORMALIZE_MODES", "RunningMeanStd", "clip_values", "whiten"]

#: Accepted values of ``reward.normalize``.
NORMALIZE_MODES = ("none", "batch", "running")
#: Added to the standard deviation before dividing.
EPS = 1e-6


def clip_values(values: Sequence[float], clip: tuple[float, float]) -> tuple[list[float], int]:
    """Clip each value to ``[lo, hi]``.

    Returns:
        ``(clipped, n_clipped)`` where ``n_clipped`` counts values strictly outside the range.
    """
    lo, hi = clip
    out, n = [], 0
    for v in values:
        if v < lo or v > hi:
            n += 1
        out.append(min(max(v, lo), hi))
    return out, n


def _mean_m2(values: Sequence[float]) -> tuple[float, float]:
    n = len(values)
    mean = math.fsum(values) / n
    m2 = math.fsum((v - mean) ** 2 for v in values)
    return mean, m2


def whiten(values: Sequence[float]) -> tuple[list[float], float, float]:
    """``(v - mean) / (std + EPS)`` with the population std of ``values`` (float64 arithmetic).

    Returns:
        ``(whitened, mean, std)``; an empty input gives ``([], 0.0, 0.0)``.
    """
    if not values:
        return [], 0.0, 0.0
    mean, m2 = _mean_m2(values)
    std = math.sqrt(m2 / len(values))
    return [(v - mean) / (std + EPS) for v in values], mean, std


class RunningMeanStd:
    """Running mean and population variance over every value seen, merged batch by batch with
    Chan et al.'s parallel form of Welford's algorithm, in Python float64.

    ``state_dict()`` / ``load_state_dict()`` carry ``count``, ``mean`` and ``m2`` exactly (plain
    floats), so a resumed run normalises exactly as an uninterrupted one.
    """

    def __init__(self) -> None:
        self.count = 0
        self.mean = 0.0
        self.m2 = 0.0

    @property
    def var(self) -> float:
        """Population variance (0.0 before any value)."""
        return self.m2 / self.count if self.count else 0.0

    @property
    def std(self) -> float:
        return math.sqrt(self.var)

    def update(self, values: Sequence[float]) -> None:
        """Fold a batch of finite values into the statistics (no-op for an empty batch)."""
        n_b = len(values)
        if not n_b:
            return
        mean_b, m2_b = _mean_m2(values)
        n_a = self.count
        n = n_a + n_b
        delta = mean_b - self.mean
        self.mean = self.mean + delta * n_b / n
        self.m2 = self.m2 + m2_b + delta * delta * n_a * n_b / n
        self.count = n

    def normalize(self, values: Sequence[float]) -> list[float]:
        """``(v - mean) / (std + EPS)`` with the current statistics."""
        return [(v - self.mean) / (self.std + EPS) for v in values]

    def state_dict(self) -> dict:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: dict) -> None:
        """Restore from :meth:`state_dict`.

        Raises:
            ValueError: missing keys or invalid values (negative count or m2, non-finite numbers).
        """
        try:
            count, mean, m2 = int(state["count"]), float(state["mean"]), float(state["m2"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"bad RunningMeanStd state {state!r}: {e}") from e
        if count < 0 or m2 < 0 or not math.isfinite(mean) or not math.isfinite(m2):
            raise ValueError(f"bad RunningMeanStd state {state!r}")
        self.count, self.mean, self.m2 = count, mean, m2
