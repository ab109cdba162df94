"""Embedded tasks: the digit-sum task, its tiny reference policy and exact enumeration.

* :mod:`tether.tasks.digitsum`: prompts, the rule-based reward ``compute_score`` and verl-schema rows.
* :mod:`tether.tasks.digitsum_hack`: the same prompts with a flawed proxy reward and exact correctness as gold.
* :mod:`tether.tasks.digitsum_tool`: the multi-turn task, the sum hidden until a tool call reveals it (an ``AGENT``
  section and its own reference).
* :mod:`tether.tasks.sft`: the character-level tokenizer and the SFT-built reference policy
  (``build_reference``, ``ensure_reference``, ``default_reference_path``, ``load_reference``).
* :mod:`tether.tasks.exact`: exact enumeration of responses and the KL-regularized optimum π*.

Only :mod:`digitsum`, :mod:`digitsum_hack` and :mod:`digitsum_tool` are imported eagerly; the others load
torch/transformers on first use.
"""

from pathlib import Path
from types import ModuleType

from tether.tasks import digitsum, digitsum_hack, digitsum_tool
from tether.tasks.digitsum import DATA_SOURCE, MAX_NEW_TOKENS, compute_score, make_dataset, make_prompt

#: ``data.embedded_task`` -> its module (``DATA_SOURCE``, ``compute_score`` (the training reward), ``make_dataset``; a
#: ``gold_score`` where the training reward is a proxy)
EMBEDDED_TASKS: dict[str, ModuleType] = {
    "digitsum": digitsum,
    "digitsum_hack": digitsum_hack,
    "digitsum_tool": digitsum_tool,
}


def embedded_task(name: str) -> ModuleType:
    """The module of an embedded task (``data.embedded_task``). Raises ValueError naming the valid ones."""
    if name not in EMBEDDED_TASKS:
        raise ValueError(f"unknown embedded task {name!r}; valid: {', '.join(EMBEDDED_TASKS)}")
    return EMBEDDED_TASKS[name]


def embedded_reference(name: str = "digitsum") -> Path:
    """The model directory ``actor.model=embedded`` stands for under ``data.embedded_task=name``: the task module's
    own reference where it names one (``reference_path()``: digitsum_tool's, which calls the tool), else the shipped
    digit-sum reference (:func:`tether.tasks.sft.ensure_reference`, built if missing). Raises ValueError for an
    unknown task."""
    mod = embedded_task(name)
    if hasattr(mod, "reference_path"):
        return Path(mod.reference_path())
    from tether.tasks.sft import ensure_reference

    return Path(ensure_reference())


__all__ = [
    "DATA_SOURCE",
    "EMBEDDED_TASKS",
    "MAX_NEW_TOKENS",
    "compute_score",
    "embedded_reference",
    "embedded_task",
    "make_dataset",
    "make_prompt",
]
