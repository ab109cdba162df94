"""actor.model=embedded follows data.embedded_task: the tool task's own reference, the digit-sum one otherwise."""

import pytest

from tether.models import resolve_model_path
from tether.tasks import digitsum_tool, embedded_reference
from tether.tasks.sft import default_reference_path


def test_embedded_model_follows_the_task():
    assert resolve_model_path("embedded", task="digitsum_tool") == digitsum_tool.reference_path()
    assert resolve_model_path("embedded", task="digitsum") == default_reference_path()
    assert resolve_model_path("embedded", task="digitsum_hack") == default_reference_path()
    assert resolve_model_path("embedded") == default_reference_path()  # the default demo: unchanged
    assert digitsum_tool.reference_path() != default_reference_path()


def test_unknown_task_is_refused():
    with pytest.raises(ValueError, match="unknown embedded task 'nope'"):
        embedded_reference("nope")


def test_tool_task_score_and_gold():
    # the score is 0 (the environment's turn rewards are the reward); the gold reads the final answer
    assert digitsum_tool.compute_score("=13=490", "3,13") == 0.0
    assert digitsum_tool.gold_score("=13=490", "3,13") == 1.0  # after the call: 4+9+0 = 13
    assert digitsum_tool.gold_score("490", "3,13") == 1.0  # a direct answer, right by luck
    assert digitsum_tool.gold_score("=13=491", "3,13") == 0.0
    assert digitsum_tool.gold_score("=13=", "3,13") == 0.0  # called, then answered nothing
    assert digitsum_tool.gold_score("=12=490", "3,13") == 0.0  # not this puzzle's observation: no answer reads 13
