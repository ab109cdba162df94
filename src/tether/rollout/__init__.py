"""Generation engines: Hugging Face ``generate`` (CPU default) and vLLM (GPU extra)."""

from tether.rollout.hf import HFRolloutEngine, response_mask_from_ids, truncated_rows

__all__ = ["HFRolloutEngine", "response_mask_from_ids", "truncated_rows"]
