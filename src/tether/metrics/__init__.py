"""Metrics computed from rollouts: diversity and mode collapse (see ``docs/metrics.md``)."""

from tether.metrics.diversity import (
    collapse_rate,
    distinct_n,
    diversity_metrics,
    prompt_response_similarity,
    self_bleu,
    unique_frac,
)

__all__ = [
    "collapse_rate",
    "distinct_n",
    "diversity_metrics",
    "prompt_response_similarity",
    "self_bleu",
    "unique_frac",
]
