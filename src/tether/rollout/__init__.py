"""Generation: the engine protocol (:mod:`tether.rollout.engine`), the engines (HF ``generate``, the CPU default;
vLLM, an extra), the registry that builds them (:mod:`tether.rollout.registry`, over :mod:`tether.engines`), and the
runner that turns prompts into a batch of trajectories (:mod:`tether.rollout.runner`)."""

from tether.rollout.engine import (
    FINISH_REASONS,
    EngineCapabilities,
    GenerationEngine,
    GenerationRequest,
    GenerationResult,
    SamplingParams,
)
from tether.rollout.hf import HFRolloutEngine, response_mask_from_ids, truncated_rows

__all__ = [
    "FINISH_REASONS",
    "EngineCapabilities",
    "GenerationEngine",
    "GenerationRequest",
    "GenerationResult",
    "HFRolloutEngine",
    "SamplingParams",
    "response_mask_from_ids",
    "truncated_rows",
]
