"""Evaluation, in one place: validation during training, ``tether eval``, and the sweep's final exact evaluation.

* :mod:`tether.evaluation.sampled`: n sampled responses per prompt through a rollout engine, scored by a reward (and a
  gold reward): ``pass@k``, ``maj@k``, ``mean@n``, diversity, lengths (:func:`evaluate_prompts`).
* :mod:`tether.evaluation.exact`: exact/* on the embedded task by enumeration (during training: :func:`exact_metrics`;
  a finished run: :func:`evaluate_final`). Whether it applies is ``TetherConfig.exact_evaluation_applies``.
* :mod:`tether.evaluation.validation`: ``val/*`` and ``exact/*`` of the trainer's validation (:func:`validate`).
* :mod:`tether.evaluation.evaluate`: ``tether eval`` on a model directory, a checkpoint or a run's checkpoints.
"""

from tether.evaluation.exact import EXACT_FINAL, ExactCache, evaluate_final, exact_metrics, exact_prompts
from tether.evaluation.sampled import evaluate_prompts
from tether.evaluation.validation import validate

__all__ = [
    "EXACT_FINAL",
    "ExactCache",
    "evaluate_final",
    "evaluate_prompts",
    "exact_metrics",
    "exact_prompts",
    "validate",
]
