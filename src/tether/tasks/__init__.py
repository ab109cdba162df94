"""Embedded tasks: the digit-sum task, its tiny reference policy and exact enumeration.

* :mod:`tether.tasks.digitsum`: prompts, the rule-based reward ``compute_score`` and verl-schema rows.
* :mod:`tether.tasks.sft`: the character-level tokenizer and the SFT-built reference policy
  (``build_reference``, ``ensure_reference``, ``default_reference_path``, ``load_reference``).
* :mod:`tether.tasks.exact`: exact enumeration of responses and the KL-regularized optimum π*.

Only :mod:`digitsum` is imported eagerly; the others load torch/transformers on first use.
"""

from tether.tasks.digitsum import DATA_SOURCE, MAX_NEW_TOKENS, compute_score, make_dataset, make_prompt

__all__ = ["DATA_SOURCE", "MAX_NEW_TOKENS", "compute_score", "make_dataset", "make_prompt"]
