"""The gold reward of validation: a second reward that scores the *same* sampled validation responses
as the training reward, so that a run trained on a proxy (a reward model, a rule with a flaw) also
reports what a verifier says of them (``val/gold_mean``, ``val/gold_gap``). See
``docs/rewards.md#gold-reward-for-validation``.

Which reward is the gold, in this order:

1. ``reward.val_function`` (a batch function, loaded and checked exactly like ``reward.function``) or
   ``reward.val_model`` (a local sequence-classification reward model, like ``reward.model``): it
   scores every row;
2. otherwise, per row, the built-in gold of the row's ``data_source``
   (:data:`tether.rewards.registry.GOLD_FUNCTIONS`), when one is registered;
3. otherwise the row has no gold: the training reward is its own gold, and nothing is logged for it.

A gold reward never stops a run: it is called through a :class:`~tether.rewards.RewardManager`
(``reward.timeout_s``, a raising batch retried sample by sample, NaN and non-numbers counted), and a
call that still raises marks every sample of the batch unscored. Unscored samples count 0, as for the
training reward's ``val/score_mean``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .manager import MAX_ERRORS, RewardManager, _brief
from .registry import GOLD_FUNCTIONS, get_gold_function

__all__ = ["GOLD_KEYS", "GoldResult", "GoldReward"]

#: The config keys of a user gold reward.
GOLD_KEYS = ("reward.val_function", "reward.val_model")


@dataclass
class GoldResult:
    """Gold scores of one batch of B responses.

    Attributes:
        covered: (B,) the row has a gold reward (user gold: every row; built-in: a source in GOLD_FUNCTIONS).
        scored: (B,) the gold reward gave a finite number (False where not covered, or an error, a
            timeout, a non-finite or non-numeric value).
        scores: (B,) the gold score as returned (raw: no clip, no normalisation, as ``val/score_mean``
            reads the training reward); 0.0 where not scored.
        errors: the first messages, each naming the sample's index in the batch.
    """

    covered: list[bool]
    scored: list[bool]
    scores: list[float]
    errors: list[str] = field(default_factory=list)

    @property
    def unscored(self) -> int:
        """Covered samples the gold could not score."""
        return sum(c and not s for c, s in zip(self.covered, self.scored, strict=True))


def _builtin_gold(data_source: str):
    fn = get_gold_function(data_source)
    if fn is None:  # not reached: GoldReward only passes covered rows
        raise ValueError(f"no built-in gold reward for data_source {data_source!r}")
    return fn


class GoldReward:
    """The gold reward (module docstring): ``gold(rows, prompts, responses) -> GoldResult | None``
    (None when no row of the batch has a gold).

    Args:
        function: ``reward.val_function`` (``"path/file.py:name"`` or ``"module:name"``), or None.
        reward_model: ``reward.val_model`` (a local reward-model directory), or None.
        timeout_s: ``reward.timeout_s``; device, model_batch_size: as for ``reward.model``.
        base_dir: directory of a relative ``function`` file (default: the current directory).

    Raises:
        ValueError: both set (naming both keys); a function or model that cannot be loaded (the
            messages of ``reward.function`` / ``reward.model``, naming ``reward.val_function`` /
            ``reward.val_model``).
    """

    def __init__(
        self,
        function: str | None = None,
        reward_model: str | None = None,
        *,
        timeout_s: float | None = None,
        device: str = "cpu",
        model_batch_size: int = 16,
        base_dir: str | Path | None = None,
    ):
        if function and reward_model:
            raise ValueError(
                f"{GOLD_KEYS[0]}={function!r} and {GOLD_KEYS[1]}={reward_model!r} are both set: the gold reward of "
                "validation is one of them; unset one"
            )
        self.function = function or None
        self.reward_model = str(reward_model) if reward_model else None
        self.user = bool(self.function or self.reward_model)
        key, value = (GOLD_KEYS[0], self.function) if self.function else (GOLD_KEYS[1], self.reward_model)
        try:
            self.manager = RewardManager(
                function=self.function,
                reward_model=self.reward_model,
                timeout_s=timeout_s,
                device=device,
                model_batch_size=model_batch_size,
                base_dir=base_dir,
                builtin=None if self.user else _builtin_gold,
                keys=GOLD_KEYS,
            )
        except ValueError as e:
            if not self.user or key in str(e):
                raise
            raise ValueError(f"{key}={value!r}: {e}") from e

    def covers(self, data_source: str) -> bool:
        """Whether rows of ``data_source`` have a gold reward."""
        return self.user or data_source in GOLD_FUNCTIONS

    def name(self, data_source: str | None = None) -> str:
        """What the gold of ``data_source`` is, in words: ``reward.val_function SPEC``, ``reward.val_model
        DIR``, ``built-in gold MODULE:FUNCTION``, or ``none``."""
        if self.function:
            return f"{GOLD_KEYS[0]} {self.function}"
        if self.reward_model:
            return f"{GOLD_KEYS[1]} {self.reward_model}"
        path = GOLD_FUNCTIONS.get(data_source) if data_source is not None else None
        return f"built-in gold {path}" if path else "none"

    def check_rows(self, rows: Sequence[Any]) -> list[str]:
        """The data sources of ``rows`` that have a gold, in order of first appearance; fails before
        training when a built-in gold of theirs cannot be imported.

        Raises:
            ValueError: a GOLD_FUNCTIONS entry whose module or function cannot be loaded.
        """
        sources = [ds for ds in dict.fromkeys(r.data_source for r in rows) if self.covers(ds)]
        if not self.user:
            for ds in sources:
                get_gold_function(ds)
        return sources

    def __call__(self, rows: Sequence[Any], prompts: Sequence[str], responses: Sequence[str]) -> GoldResult | None:
        """Gold scores of B responses; None when no row has a gold. Never raises for the reward's
        own failures (counted as unscored samples, described in ``errors``)."""
        b = len(rows)
        covered = [self.covers(r.data_source) for r in rows]
        idx = [i for i, c in enumerate(covered) if c]
        if not idx:
            return None
        scored, scores, errors = [False] * b, [0.0] * b, []
        try:
            res = self.manager([rows[i] for i in idx], [prompts[i] for i in idx], [responses[i] for i in idx])
        except Exception as e:  # noqa: BLE001 - a gold reward never stops a run: its samples are unscored
            errors.append(
                f"samples {idx[0]}..{idx[-1]}: the gold reward {self.name(rows[idx[0]].data_source)} raised {_brief(e)}"
            )
            return GoldResult(covered, scored, scores, errors)
        for j, i in enumerate(idx):
            if bool(res.valid[j]):
                scored[i], scores[i] = True, float(res.raw_scores[j])
        for msg in res.errors:  # "sample j: ..." of the covered subset -> the batch's index
            head, sep, rest = msg.partition(": ")
            if sep and head.startswith("sample ") and head[7:].isdigit() and int(head[7:]) < len(idx):
                msg = f"sample {idx[int(head[7:])]}: {rest}"
            errors.append(msg)
        return GoldResult(covered, scored, scores, errors[:MAX_ERRORS])
