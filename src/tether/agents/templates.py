"""Observations as token ids, once; and the prefix check: each turn's context against the chat template.

Token in, token out: a trajectory's context is the prompt's ids, then the model's ids exactly as sampled, then each
observation's ids, appended. An observation is rendered as the chat template renders its messages (a ``tool``
message, a ``user`` message) followed by the next assistant header, tokenised once (:class:`ObservationRenderer`).

The template may still disagree with what the model saw: a template that strips ``<think>`` from earlier assistant
turns (Qwen3's, before the last user message), a turn separator it adds that the model never sampled, a model turn
whose tokens are not the tokenizer's own tokenisation of its text. :func:`first_mismatch` and
:func:`check_turn_contexts` compare, before training, each turn's context with the template's tokens for the
conversation so far (``apply_chat_template(messages, add_generation_prompt=True)``).

Source: the check is prime-rl's "each prompt extends the previous one token for token"; the drift it catches is
that of verl #3960/#6854 and Qwen3's template.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["ObservationRenderer", "PrefixMismatch", "check_turn_contexts", "first_mismatch", "mismatch_message"]

_PROBE_USER, _PROBE_REPLY = "q", "r"


class ObservationRenderer:
    """Observation messages → the token ids appended after a model turn that ended with an EOS id.

    The text is what the chat template puts between the end of an assistant turn and the model's next turn: what
    follows the assistant's EOS in its rendering (Qwen's ``\\n`` after ``<|im_end|>``), the observation messages,
    the next assistant header. It is found once per call by rendering a probe conversation with and without them.
    Without a chat template, each observation content is written as
    ``\\n<observation>\\n{content}\\n</observation>\\n``.

    Args:
        tokenizer: a Hugging Face tokenizer; tools: the ``tools`` schemas the template gets (or None);
        eos_texts: the texts of the ids that end a model turn (``<|im_end|>``, ``<|eot_id|>``).
        max_tokens: the most tokens of observation content per observation (the messages' contents together, cut
            in order); None: no limit.

    Raises:
        ValueError: (on first use) a template that does not end an assistant turn with one of ``eos_texts``, or
            whose rendering with more messages does not extend its rendering with fewer.
    """

    def __init__(self, tokenizer, *, tools: list[dict] | None, eos_texts: list[str], max_tokens: int | None):
        self.tok, self.tools, self.eos_texts, self.max_tokens = tokenizer, tools, list(eos_texts), max_tokens
        self.templated = bool(getattr(tokenizer, "chat_template", None))

    def _render(self, messages: list[dict], generation: bool) -> str:
        return self.tok.apply_chat_template(
            messages, tools=self.tools, add_generation_prompt=generation, tokenize=False
        )

    def truncate(self, messages: list[dict]) -> list[dict]:
        """``messages`` with their contents cut to :attr:`max_tokens` tokens in all (in order; later ones may be
        left empty)."""
        if self.max_tokens is None:
            return messages
        budget, out = self.max_tokens, []
        for m in messages:
            ids = self.tok(m["content"], add_special_tokens=False)["input_ids"]
            if len(ids) > budget:
                m = {**m, "content": self.tok.decode(ids[:budget])}
            budget = max(0, budget - len(ids))
            out.append(m)
        return out

    def text(self, messages: list[dict]) -> str:
        """The text appended after a model turn's EOS for ``messages`` (already truncated)."""
        if not self.templated:
            return "".join(f"\n<observation>\n{m['content']}\n</observation>\n" for m in messages)
        base = [{"role": "user", "content": _PROBE_USER}, {"role": "assistant", "content": _PROBE_REPLY}]
        before = self._render(base, False)
        after = self._render(base + messages, True)
        if not after.startswith(before):
            raise ValueError(
                "the chat template's rendering of a conversation with an observation does not extend its rendering "
                "without it, so an observation cannot be appended as tokens; use a template that renders messages "
                "in order"
            )
        ends = [before.rfind(_PROBE_REPLY + e) for e in self.eos_texts]
        hit = max(range(len(ends)), key=lambda i: ends[i]) if ends else None
        if hit is None or ends[hit] < 0:
            raise ValueError(
                f"the chat template does not end an assistant turn with an end-of-turn token ({self.eos_texts}); "
                "a model turn must end where the template's assistant turn ends"
            )
        separator = before[ends[hit] + len(_PROBE_REPLY) + len(self.eos_texts[hit]) :]
        return separator + after[len(before) :]

    def __call__(self, messages: list[dict]) -> tuple[list[int], list[dict]]:
        """(token ids to append, the messages as rendered: contents truncated)."""
        messages = self.truncate(messages)
        return self.tok(self.text(messages), add_special_tokens=False)["input_ids"], messages


def plain_observation_problem(tokenizer, sample: str = "0") -> str | None:
    """Why ``tokenizer`` (one without a chat template) cannot encode an observation in the plain wrapper
    (:meth:`ObservationRenderer.text`): the encoder raises, or gives its unknown-token id; None when it can, or when
    the tokenizer has a chat template (its rendering is checked per turn). ``sample``: the probe's content."""
    if getattr(tokenizer, "chat_template", None):
        return None
    text = ObservationRenderer(tokenizer, tools=None, eos_texts=[], max_tokens=None).text(
        [{"role": "user", "content": sample}]
    )
    try:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    except Exception as e:  # noqa: BLE001 - any encoder failure is the answer
        return f"encoding {text!r} raised {type(e).__name__}: {e}"
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is not None and unk in ids:
        return f"encoding {text!r} gives the unknown token {tokenizer.unk_token!r}"
    return None


def first_mismatch(actual: list[int], expected: list[int]) -> int | None:
    """The first position where ``actual`` and ``expected`` differ (including one ending before the other), or None
    when they are equal. Pure; O(length)."""
    n = min(len(actual), len(expected))
    for i in range(n):
        if actual[i] != expected[i]:
            return i
    return None if len(actual) == len(expected) else n


@dataclass(frozen=True)
class PrefixMismatch:
    """Where a turn's context leaves the template: ``turn`` (1-based model turn whose context differs),
    ``position`` (token index in that context), and the ids there (None past the end of one of them)."""

    turn: int
    position: int
    actual_id: int | None
    expected_id: int | None


def check_turn_contexts(contexts: list[list[int]], expected: list[list[int]]) -> PrefixMismatch | None:
    """The first turn whose context is not the template's tokens for the conversation so far.

    Args:
        contexts: per model turn, the token ids the engine was given (prompt and everything before the turn).
        expected: per model turn, ``apply_chat_template(conversation so far, add_generation_prompt=True)`` ids.

    Returns:
        None when every turn matches; else the first :class:`PrefixMismatch`.

    Raises:
        ValueError: the two lists differ in length.
    """
    if len(contexts) != len(expected):
        raise ValueError(f"{len(contexts)} turn contexts but {len(expected)} expected renderings")
    for k, (a, e) in enumerate(zip(contexts, expected, strict=True)):
        i = first_mismatch(a, e)
        if i is not None:
            return PrefixMismatch(k + 1, i, a[i] if i < len(a) else None, e[i] if i < len(e) else None)
    return None


def mismatch_message(sample: int, m: PrefixMismatch, tokenizer: Any) -> str:
    """One line naming the sample, the turn and the first differing token (id and text) on each side."""

    def show(t):
        return "(end)" if t is None else f"{t} {tokenizer.decode([t])!r}"

    return (
        f"agent prefix check: sample {sample}, turn {m.turn}: the context differs from the chat template's rendering "
        f"of the conversation at token {m.position}: the model saw {show(m.actual_id)}, the template gives "
        f"{show(m.expected_id)}; fix the template (e.g. one that strips <think> from earlier turns) or set "
        "agent.on_prefix_mismatch=count to train on the tokens as sampled"
    )
