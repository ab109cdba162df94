"""The embedded multi-turn task: the digit-sum prompt with the target sum hidden until a tool reveals it.

A prompt names the number of digits ``k`` and a puzzle number, not the sum: ``"3,,07="`` is puzzle 7, three digits.
Each puzzle has a fixed target sum (:data:`PUZZLE_SUMS`, a seeded shuffle of 4..23 with no relation to the puzzle
number), which only the environment knows. Two model turns at most (``agent.max_turns=2``):

* turn 1 is either the **call** :data:`CALL` (the single token ``"="`` then EOS): the environment answers with the
  observation ``"{s}="`` (e.g. ``"13="``, a few tokens of the task's own tokenizer), per-turn reward 0, and the
  model takes turn 2; or a **direct answer**, scored at once (1 if it is k digits summing to s, else 0), which ends
  the episode: right only by luck, since the prompt does not say s;
* turn 2 is the answer, scored the same way; the episode ends.

The environment is deterministic, so a trajectory's probability is the product of the model's token probabilities
(observation tokens are not actions) and every trajectory can be enumerated (:func:`tether.tasks.exact.
enumerate_trajectories`): 41,370 direct answers plus 41,371 answers after the call for k = 3 (turns of at most
k + 1 tokens). π*_β ∝ π_ref·exp(r/β) over trajectories is then exact, as for the single-turn task (docs/task.md).

The transition is :func:`transition` (pure); :class:`tether.agents.digitsum_tool.DigitSumToolEnvironment` is the
``agent.environment`` that runs it in the turn loop (:data:`AGENT`: what ``data.embedded_task=digitsum_tool`` sets).
The task's reference policy (:func:`tether.tasks.sft.build_tool_reference`, shipped in ``assets/digitsum_tool_ref``)
calls the tool some of the time; its tokenizer is the digit-sum one plus a chat template (:data:`CHAT_TEMPLATE`) under
which an observation is its text and an assistant turn ends with EOS.
"""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

from tether.tasks import digitsum

DATA_SOURCE = "tether/digitsum_tool"
ABILITY = "tool_use"
#: The model turn that calls the tool (then EOS): one token of the embedded tokenizer.
CALL = "="
#: Digits per answer; the turn budget is k + 1 tokens (the digits and EOS), :data:`MAX_NEW_TOKENS`.
DEFAULT_K = digitsum.DEFAULT_K
MAX_NEW_TOKENS = DEFAULT_K + 1
#: Model turns per trajectory: the call, then the answer.
MAX_TURNS = 2
#: Target sum of each puzzle number 0..19: 4..23 shuffled with ``random.Random(30)``, so the number says nothing.
PUZZLE_SUMS: tuple[int, ...] = tuple(random.Random(30).sample(range(4, 24), 20))
#: Puzzles held out of the training split: those whose sum is one of the single-turn task's validation sums.
VAL_PUZZLES: tuple[int, ...] = tuple(p for p, s in enumerate(PUZZLE_SUMS) if s in digitsum.VAL_S)

#: What ``data.embedded_task=digitsum_tool`` sets in the ``agent`` section where those keys are left unset.
AGENT = {"environment": "tether.agents.digitsum_tool:DigitSumToolEnvironment", "max_turns": MAX_TURNS}

#: Chat template of the task's tokenizer: every message's content in order, an assistant's followed by EOS; no
#: generation prompt. Under it an observation (a ``user`` message) renders as its own text.
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% if m['role'] == 'assistant' %}</s>{% endif %}{% endfor %}"

_ASSET_DIR = Path(__file__).resolve().parent / "assets" / "digitsum_tool_ref"
_PROMPT_RE = re.compile(r"^\s*(\d+)\s*,\s*,\s*(\d+)\s*=\s*$")
_SPLITS = ("train", "val", "all")


def make_prompt(k: int, puzzle: int) -> str:
    """``make_prompt(3, 7) == "3,,07="``. Raises ValueError for k < 1 or a puzzle outside 0..19."""
    digitsum._check_k(k)
    _check_puzzle(puzzle)
    return f"{k},,{puzzle:02d}="


def parse_prompt(prompt: str) -> tuple[int, int]:
    """``"3,,07="`` -> ``(3, 7)``: (k, puzzle). Raises ValueError for another shape or an unknown puzzle."""
    m = _PROMPT_RE.match(prompt)
    if m is None:
        raise ValueError(f"prompt {prompt!r} is not a digitsum_tool prompt of the form 'k,,NN=' (e.g. '3,,07=')")
    k, puzzle = int(m.group(1)), int(m.group(2))
    _check_puzzle(puzzle)
    return k, puzzle


def observation_text(s: int) -> str:
    """What the tool answers: ``"{s}="``."""
    return f"{s}="


def transition(k: int, s: int, turn: int, text: str) -> tuple[str | None, float, bool]:
    """The environment's deterministic step: ``(observation or None, this turn's reward, done)`` after model turn
    ``turn`` (1-based) wrote ``text`` (decoded without special tokens).

    Turn 1 :data:`CALL` (surrounding whitespace ignored): the observation ``"{s}="``, reward 0, not done. Any other
    turn 1, and every turn 2: reward 1.0 if the text is k digits summing to s else 0.0, done.
    """
    if turn == 1 and text.strip() == CALL:
        return observation_text(s), 0.0, False
    return None, (1.0 if digitsum.is_correct(text.strip(), k, s) else 0.0), True


def compute_score(solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    """The trajectory's score in training (verl's signature, the built-in reward of :data:`DATA_SOURCE`): always
    0.0. The environment's per-turn rewards (:func:`transition`, on each turn's last model token) are the task's
    reward, as the enumeration counts it; a score on the decoded trajectory would count the answer twice."""
    if not isinstance(solution_str, str):
        raise TypeError(f"solution_str must be str, got {type(solution_str).__name__}")
    return 0.0


def gold_score(solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    """Correctness of a decoded trajectory (the validation gold of :data:`DATA_SOURCE`: ``val/gold_mean``): the
    answer is the text after the call and its observation (``"=13=490"`` -> ``"490"``) when the trajectory starts
    with them, else the whole text (a direct answer); 1.0 when it is k digits summing to s. Equals the sum of the
    environment's rewards except on a turn cut by the length limit whose text still reads as an answer (a BOS or
    pad token decodes to nothing): the environment scores such a turn 0."""
    if not isinstance(solution_str, str):
        raise TypeError(f"solution_str must be str, got {type(solution_str).__name__}")
    k, s = digitsum.parse_ground_truth(ground_truth)
    text = solution_str.strip()
    head = CALL + observation_text(s)
    answer = text[len(head) :] if text.startswith(head) else text
    return 1.0 if digitsum.is_correct(answer.strip(), k, s) else 0.0


def split_puzzles(split: str) -> list[int]:
    """Puzzle numbers of a split: ``"val"`` :data:`VAL_PUZZLES`, ``"train"`` the other 16, ``"all"`` 0..19."""
    if split not in _SPLITS:
        raise ValueError(f"split must be one of {_SPLITS}, got {split!r}")
    every = list(range(len(PUZZLE_SUMS)))
    if split == "all":
        return every
    return list(VAL_PUZZLES) if split == "val" else [p for p in every if p not in VAL_PUZZLES]


def make_row(k: int, puzzle: int, index: int, split: str) -> dict:
    """One row in verl's schema; ``extra_info.interaction_kwargs`` (k, s) builds the row's environment."""
    s = PUZZLE_SUMS[puzzle]
    return {
        "data_source": DATA_SOURCE,
        "prompt": make_prompt(k, puzzle),
        "ability": ABILITY,
        "reward_model": {"style": "rule", "ground_truth": f"{k},{s}"},
        "extra_info": {
            "k": k,
            "s": s,
            "puzzle": puzzle,
            "index": index,
            "split": split,
            "interaction_kwargs": {"k": k, "s": s},
        },
    }


def make_dataset(split: str, n: int | None = None, seed: int = 0, *, k: int = DEFAULT_K) -> list[dict]:
    """Rows of the task: one per puzzle of the split (``n=None``), or ``n`` rows in shuffled rounds seeded by ``seed``
    (as :func:`tether.tasks.digitsum.make_dataset`). Raises ValueError for an unknown split or ``n < 1``."""
    puzzles = split_puzzles(split)
    if n is None:
        order = puzzles
    else:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be a positive int or None, got {n!r}")
        rng, order = random.Random(seed), []
        while len(order) < n:
            perm = list(puzzles)
            rng.shuffle(perm)
            order.extend(perm)
        order = order[:n]
    return [make_row(k, p, i, split) for i, p in enumerate(order)]


def _check_puzzle(puzzle: int) -> None:
    if isinstance(puzzle, bool) or not isinstance(puzzle, int) or not 0 <= puzzle < len(PUZZLE_SUMS):
        raise ValueError(f"puzzle must be an int in 0..{len(PUZZLE_SUMS) - 1}, got {puzzle!r}")


# ---------------------------------------------------------------------------------------------- the reference

#: Demonstrations of the reference: the share that call the tool, and after the call the share answered correctly
#: (uniform among the valid answers; otherwise k digits with another sum). A direct answer is k uniform digits (it
#: cannot depend on s, which the prompt does not give).
DEFAULT_P_CALL = 0.4
DEFAULT_P_CORRECT_AFTER_CALL = 0.7
DEFAULT_DEMOS_PER_PUZZLE = 500
DEFAULT_STEPS = 1500


def make_demonstrations(
    per_puzzle: int = DEFAULT_DEMOS_PER_PUZZLE,
    *,
    p_call: float = DEFAULT_P_CALL,
    p_correct: float = DEFAULT_P_CORRECT_AFTER_CALL,
    seed: int = 0,
    k: int = DEFAULT_K,
) -> list[list[tuple[str, bool]]]:
    """Two-turn demonstrations over every puzzle: each a list of ``(text, is_model_turn)`` segments after BOS, the
    prompt first (``[(prompt, False), ("=", True), ("13=", False), ("490", True)]`` or ``[(prompt, False),
    ("271", True)]``); a model turn is followed by EOS. Deterministic for a seed."""
    for name, p in (("p_call", p_call), ("p_correct", p_correct)):
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {p!r}")
    rng = random.Random(seed)
    demos = []
    for puzzle in split_puzzles("all"):
        s = PUZZLE_SUMS[puzzle]
        valid = digitsum.valid_answers(k, s)
        prompt = make_prompt(k, puzzle)
        for _ in range(per_puzzle):
            if rng.random() < p_call:
                if rng.random() < p_correct:
                    answer = rng.choice(valid)
                else:
                    while digitsum.is_correct(answer := "".join(rng.choice("0123456789") for _ in range(k)), k, s):
                        pass
                demos.append([(prompt, False), (CALL, True), (observation_text(s), False), (answer, True)])
            else:
                demos.append([(prompt, False), ("".join(rng.choice("0123456789") for _ in range(k)), True)])
    return demos


def reference_path() -> Path:
    """The shipped reference of this task, ``src/tether/tasks/assets/digitsum_tool_ref/``."""
    return _ASSET_DIR
