"""Turning a :class:`~tether.data.rows.PromptRow` into the text the policy is conditioned on.

Rules (:func:`render_prompt`):

* **chat prompts** (a list of messages) with ``apply_chat_template=True`` and a tokenizer that has a
  chat template: ``tokenizer.apply_chat_template(messages, add_generation_prompt=True,
  tokenize=False)``, as verl does for its ``prompt`` column. The instruction suffix is appended to
  the *content of the last user message* before templating (so it lands inside the user turn, not
  after the assistant header).
* **chat prompts without a chat template** (or ``apply_chat_template=False``): the message contents
  joined with a blank line (``"\\n\\n"``), roles dropped, no generation prompt, suffix appended to the
  last user message. A single-message prompt is therefore just its content: what a base model
  should see. Give the tokenizer a chat template when roles matter. :func:`check_chat_template`
  (called by the trainer and ``tether eval`` before any work) warns once when this happens with
  ``apply_chat_template=True``, and refuses multi-turn conversations, whose joined text would
  erase who said what.
* **plain string prompts** are used raw (plus the suffix appended to the end), never wrapped in a
  user message, even when the tokenizer has a chat template: a string prompt is taken to be already
  formatted (e.g. a completion-style prompt, or one rendered elsewhere). Store prompts as a list of
  messages to get the chat template.
"""

from __future__ import annotations

import logging
from typing import Any

from .rows import MAX_REPORTED_ERRORS, DataError, PromptRow

__all__ = [
    "check_chat_template",
    "check_prompt_lengths",
    "has_chat_template",
    "is_multi_turn",
    "render_prompt",
    "render_prompts",
]

log = logging.getLogger("tether")
_warned_no_template: set[str] = set()  # tokenizers already warned about (once per process)


def has_chat_template(tokenizer: Any) -> bool:
    """True when ``tokenizer`` has a non-empty ``chat_template`` (a string or a dict of templates)."""
    tpl = getattr(tokenizer, "chat_template", None)
    return bool(tpl)


def is_multi_turn(messages: list[dict]) -> bool:
    """True for a conversation of more than one turn: an assistant (or tool) message, or more than
    one user message. A system message plus one user message is a single turn."""
    roles = [m.get("role") for m in messages]
    return roles.count("user") > 1 or any(r in ("assistant", "tool") for r in roles)


def check_chat_template(
    rows: list[PromptRow], tokenizer: Any, *, apply_chat_template: bool = True, what: str = "actor.model"
) -> None:
    """Say what happens to chat prompts when the tokenizer has no chat template, before any work.

    With ``apply_chat_template`` and chat-message prompts but no ``tokenizer.chat_template``: a
    warning, once per tokenizer and process, saying that the message contents are joined instead
    and how to set a template; an error when a prompt is a multi-turn conversation
    (:func:`is_multi_turn`). Nothing otherwise (string prompts, a template, or
    ``apply_chat_template=False``, which asks for the joined text explicitly).

    Raises:
        DataError: a multi-turn conversation and no chat template (naming the first such row, its
            roles, and the number of such rows).
    """
    if not apply_chat_template or tokenizer is None or has_chat_template(tokenizer):
        return
    chats = [r for r in rows if isinstance(r.prompt, list)]
    if not chats:
        return
    name = str(getattr(tokenizer, "name_or_path", "") or what)
    how = (
        'set a template in the model directory (a "chat_template" entry in tokenizer_config.json, or a '
        "chat_template.jinja file; e.g. tokenizer.chat_template = ...; tokenizer.save_pretrained(DIR))"
    )
    multi = [r for r in chats if is_multi_turn(r.prompt)]
    if multi:
        first = multi[0]
        roles = ", ".join(str(m.get("role")) for m in first.prompt)
        raise DataError(
            f"{len(multi)} prompt(s) are multi-turn conversations (first: {first.where}, roles {roles}) but the "
            f"tokenizer of {what} ({name}) has no chat template: joining the turns would erase who said what. To train "
            f"on them, {how}; or give single-turn prompts",
            [r.where for r in multi[:MAX_REPORTED_ERRORS]],
            len(multi),
        )
    if name not in _warned_no_template:
        _warned_no_template.add(name)
        log.warning(
            "the tokenizer of %s (%s) has no chat template: the %d chat prompt(s) are rendered as their message "
            "contents joined by a blank line, roles dropped and no generation prompt (right for a base model, wrong "
            "for a chat model). To use a template, %s; data.apply_chat_template=false uses the joined text without "
            "this warning.",
            what,
            name,
            len(chats),
            how,
        )


def _with_suffix(messages: list[dict], suffix: str) -> list[dict]:
    msgs = [dict(m) for m in messages]
    if suffix:
        for m in reversed(msgs):
            if m.get("role") == "user":
                m["content"] = m["content"] + suffix
                break
        else:  # no user message: append to the last message, whatever its role
            msgs[-1]["content"] = msgs[-1]["content"] + suffix
    return msgs


def render_prompt(
    row: PromptRow,
    tokenizer: Any,
    *,
    apply_chat_template: bool = True,
    instruction_suffix: str = "",
) -> str:
    """Render one row's prompt as text (see the module docstring for the exact rules).

    Args:
        row: the row; ``row.prompt`` is a string or a list of chat messages.
        tokenizer: a Hugging Face tokenizer (only ``chat_template`` and ``apply_chat_template`` are
            used); may be None for string prompts and for ``apply_chat_template=False``.
        apply_chat_template: use the tokenizer's chat template for message prompts when it has one.
        instruction_suffix: text appended to the prompt (to the last user message for chat
            prompts), e.g. ``" Let's think step by step..."``. Default: nothing.

    Returns:
        The prompt text. Special tokens (e.g. ``<|im_start|>``) appear literally in the text, so
        tokenize it with ``add_special_tokens=False`` when the template already holds them.

    Raises:
        TypeError: ``row.prompt`` is neither a string nor a list (rows from ``load_rows`` never are).
    """
    prompt = row.prompt
    if isinstance(prompt, str):
        return prompt + instruction_suffix
    if not isinstance(prompt, list):
        raise TypeError(f"{row.where}: prompt must be a str or a list of messages, got {type(prompt).__name__}")
    msgs = _with_suffix(prompt, instruction_suffix)
    if apply_chat_template and tokenizer is not None and has_chat_template(tokenizer):
        out = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        if not isinstance(out, str):  # some versions return a list for batched input
            out = out[0]
        return out
    return "\n\n".join(m["content"] for m in msgs)


def render_prompts(
    rows: list[PromptRow],
    tokenizer: Any,
    *,
    apply_chat_template: bool = True,
    instruction_suffix: str = "",
) -> list[str]:
    """:func:`render_prompt` over a list of rows."""
    return [
        render_prompt(r, tokenizer, apply_chat_template=apply_chat_template, instruction_suffix=instruction_suffix)
        for r in rows
    ]


def check_prompt_lengths(
    rows: list[PromptRow],
    tokenizer: Any,
    max_prompt_length: int,
    *,
    apply_chat_template: bool = True,
    instruction_suffix: str = "",
    drop: bool = False,
) -> list[PromptRow]:
    """Find prompts longer than ``max_prompt_length`` tokens before training starts.

    Each prompt is rendered with :func:`render_prompt` and tokenized with
    ``add_special_tokens=False`` when a chat template was applied (the template already holds the
    special tokens), with the tokenizer's default otherwise.

    Args:
        rows: the dataset.
        tokenizer: the policy's tokenizer.
        max_prompt_length: the maximum prompt length in tokens (>= 1).
        apply_chat_template, instruction_suffix: as in :func:`render_prompt`.
        drop: drop the long rows (with a warning on the ``tether`` logger giving the count) instead of failing.

    Returns:
        The rows that fit (all of them, or a :class:`DataError` is raised, unless ``drop``).

    Raises:
        DataError: some prompts are too long (the first few named by row index and length) and
            ``drop`` is False, or every prompt is too long.
        ValueError: ``max_prompt_length < 1``.
    """

    if max_prompt_length < 1:
        raise ValueError(f"max_prompt_length must be >= 1, got {max_prompt_length}")
    templated = apply_chat_template and tokenizer is not None and has_chat_template(tokenizer)
    keep: list[PromptRow] = []
    long: list[str] = []
    n_long = 0
    for r in rows:
        text = render_prompt(
            r, tokenizer, apply_chat_template=apply_chat_template, instruction_suffix=instruction_suffix
        )
        kw = {"add_special_tokens": False} if templated and isinstance(r.prompt, list) else {}
        n = len(tokenizer(text, **kw)["input_ids"])
        if n > max_prompt_length:
            n_long += 1
            if len(long) < MAX_REPORTED_ERRORS:
                long.append(f"{r.where}: {n} tokens")
        else:
            keep.append(r)
    if n_long and (not drop or not keep):
        raise DataError(
            f"{n_long} prompt(s) of {len(rows)} longer than max_prompt_length={max_prompt_length} tokens: "
            + "; ".join(long)
            + (" ..." if n_long > len(long) else ""),
            long,
            n_long,
        )
    if n_long:
        log.warning("dropped %d prompt(s) longer than %d tokens: %s", n_long, max_prompt_length, "; ".join(long[:3]))
    return keep
