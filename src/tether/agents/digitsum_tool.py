"""The environment of the embedded multi-turn task (:mod:`tether.tasks.digitsum_tool`): ``agent.environment``
``tether.agents.digitsum_tool:DigitSumToolEnvironment``, set by ``data.embedded_task=digitsum_tool``."""

from __future__ import annotations

from typing import Any

from tether.agents.tools import StepResult
from tether.tasks import digitsum_tool

__all__ = ["DigitSumToolEnvironment"]


class DigitSumToolEnvironment:
    """One trajectory of the tool task: a model turn :data:`~tether.tasks.digitsum_tool.CALL` first gets the
    observation ``"{s}="`` (reward 0, one ``tool_calls`` event); any other turn is scored as the answer and ends the
    episode (:func:`tether.tasks.digitsum_tool.transition`). Built with the row's ``extra_info.interaction_kwargs``
    (``k``, ``s``); deterministic.

    Raises:
        ValueError: ``s`` outside ``0..9k`` (a row that is not the task's).
    """

    def __init__(self, k: int = digitsum_tool.DEFAULT_K, s: int | None = None):
        if not isinstance(s, int) or isinstance(s, bool) or not 0 <= s <= 9 * k:
            raise ValueError(
                f"DigitSumToolEnvironment needs s in 0..{9 * k} from the row's extra_info.interaction_kwargs, got "
                f"{s!r}; use the rows of data.embedded_task=digitsum_tool"
            )
        self.k, self.s, self.turn = int(k), s, 0

    def reset(self, row: Any) -> None:
        """No first observation: the prompt is the row's."""
        self.turn = 0
        return None

    def step(self, model_turn: str) -> StepResult:
        self.turn += 1
        obs, reward, done = digitsum_tool.transition(self.k, self.s, self.turn, model_turn)
        return StepResult(obs, reward, done, {"tool_calls": 1} if obs is not None else {})
