"""Roles that own models: actor (policy + optimizer), reference, critic.

The trainer talks to them only through ``compute_logprobs``, ``compute_values``, ``update_*``,
``state_dict`` and ``load_state_dict`` (the HybridFlow single-controller split), so that moving a
role onto another process or device changes placement, not the loop. Everything here is local and
in-process today.
"""

from tether.workers.actor import ActorWorker, ReferenceWorker
from tether.workers.common import micro_batches, mini_batches
from tether.workers.critic import CriticWorker

__all__ = ["ActorWorker", "ReferenceWorker", "CriticWorker", "micro_batches", "mini_batches"]
