"""Offline RLHF rows (fixed prompt/response pairs): pre-filtering and responses that do not fit.

Noisy offline data inflates the KL a policy must travel to fit it, so KL-regularized PPO recipes
filter the pairs first. :func:`filter_offline_rows` drops, in this order and counting each: pairs
whose score is missing or outside ``[score_min, score_max]`` (when a bound is set), empty responses
(nothing but whitespace), and repeated (prompt, response) pairs (the first is kept).

:func:`overlong_responses` finds responses that do not fit in ``max_new_tokens`` together with their
EOS (the offline rollout would cut them there without an EOS, like a generation that hit the limit).
A label given to a whole solution does not belong to its prefix, so the trainer drops them by
default (``data.overlong_responses``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from .rows import PromptRow

__all__ = ["OfflineFilterCounts", "filter_offline_rows", "overlong_responses"]


@dataclass
class OfflineFilterCounts:
    """Rows seen and dropped by :func:`filter_offline_rows`, by reason."""

    total: int = 0
    score: int = 0
    empty: int = 0
    duplicate: int = 0
    first: dict[str, int] = field(default_factory=dict)  # reason -> first dropped row index

    @property
    def dropped(self) -> int:
        return self.score + self.empty + self.duplicate

    def describe(self, score_range: tuple[float | None, float | None]) -> str:
        lo, hi = (
            ("-inf" if score_range[0] is None else f"{score_range[0]:g}"),
            ("inf" if score_range[1] is None else f"{score_range[1]:g}"),
        )
        parts = [
            f"{self.score} with a score missing or outside [{lo}, {hi}]"
            if any(b is not None for b in score_range)
            else "",
            f"{self.empty} empty response(s)" if self.empty else "",
            f"{self.duplicate} duplicate (prompt, response) pair(s)" if self.duplicate else "",
        ]
        return ", ".join(p for p in parts if p) or "nothing"


def _key(row: PromptRow) -> str:
    return json.dumps([row.prompt, row.response], sort_keys=True, ensure_ascii=False)


def filter_offline_rows(
    rows: list[PromptRow],
    *,
    score_min: float | None = None,
    score_max: float | None = None,
    drop_empty: bool = True,
    drop_duplicates: bool = False,
) -> tuple[list[PromptRow], OfflineFilterCounts]:
    """Drop low-quality offline pairs (see the module docstring); returns (kept rows, counts).

    Args:
        rows: rows with ``response`` set (and ``score`` when a bound is given).
        score_min, score_max: keep rows with ``score_min <= score <= score_max``; None = unbounded.
            With either bound set, a row without a score is dropped.
        drop_empty: drop responses that are empty or only whitespace.
        drop_duplicates: drop repeated (prompt, response) pairs, keeping the first.
    """
    counts = OfflineFilterCounts(total=len(rows))
    bounded = score_min is not None or score_max is not None
    seen: set[str] = set()
    kept = []
    for r in rows:
        reason = None
        if bounded and (
            r.score is None
            or (score_min is not None and r.score < score_min)
            or (score_max is not None and r.score > score_max)
        ):
            reason = "score"
        elif drop_empty and not (r.response or "").strip():
            reason = "empty"
        elif drop_duplicates:
            k = _key(r)
            if k in seen:
                reason = "duplicate"
            seen.add(k)
        if reason is None:
            kept.append(r)
        else:
            setattr(counts, reason, getattr(counts, reason) + 1)
            counts.first.setdefault(reason, r.index)
    return kept, counts


def overlong_responses(rows: list[PromptRow], tokenizer: Any, max_new_tokens: int) -> list[tuple[int, int]]:
    """(position in ``rows``, response length in tokens) of every response with more than
    ``max_new_tokens - 1`` tokens, i.e. that does not fit with its EOS (tokenized without special
    tokens, as the offline rollout does)."""
    out = []
    for i, r in enumerate(rows):
        n = len(tokenizer(r.response or "", add_special_tokens=False)["input_ids"])
        if n >= max_new_tokens:
            out.append((i, n))
    return out
