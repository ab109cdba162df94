"""Metrics computed from rollouts: diversity and mode collapse (see ``docs/metrics.md``), accuracy of
sampled responses (pass@k, mean@n, maj@k; see ``docs/eval.md``)."""

from tether.metrics.accuracy import accuracy_metrics, default_ks, maj_at_k, majority_vote, parse_ks, pass_at_k
from tether.metrics.diversity import (
    collapse_rate,
    distinct_n,
    diversity_metrics,
    prompt_response_similarity,
    self_bleu,
    unique_frac,
)

__all__ = [
    "accuracy_metrics",
    "default_ks",
    "maj_at_k",
    "majority_vote",
    "parse_ks",
    "pass_at_k",
    "collapse_rate",
    "distinct_n",
    "diversity_metrics",
    "prompt_response_similarity",
    "self_bleu",
    "unique_frac",
]
