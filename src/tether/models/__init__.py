"""Loading Hugging Face models and tokenizers, the critic's value head, and log-probs from a forward pass.

* :mod:`tether.models.loading`: local model directories, tokenizers, LoRA adapters (nothing is downloaded).
* :mod:`tether.models.forward`: response log-probs and entropy under autocast; the LM head's precision patch.
* :mod:`tether.models.prefix`: one forward per distinct prompt (``actor.share_prompt_prefix``).
* :mod:`tether.models.vocab_parallel`: log-probs from tensor-parallel (vocabulary-sharded) logits.
* :mod:`tether.models.value`: the critic's value model.
* :mod:`tether.models.attention`: the attention implementation (``actor.attn_implementation``).
"""

from tether.models import attention
from tether.models.forward import (
    autocast,
    fp32_lm_head,
    patch_lm_head,
    position_ids_from_mask,
    response_logprobs,
    unpatch_lm_head,
)
from tether.models.loading import DTYPES, apply_lora, load_causal_lm, load_tokenizer, resolve_model_path
from tether.models.value import ValueModel

__all__ = [
    "DTYPES",
    "ValueModel",
    "apply_lora",
    "attention",
    "autocast",
    "fp32_lm_head",
    "load_causal_lm",
    "load_tokenizer",
    "patch_lm_head",
    "position_ids_from_mask",
    "resolve_model_path",
    "response_logprobs",
    "unpatch_lm_head",
]
