"""Named model shapes for ``tether plan``: the architecture fields of published ``config.json`` files.

``tether plan ... actor.model=qwen2.5-32b`` plans a model without its directory on disk: each name
here stands for the ``config.json`` of one Hugging Face checkpoint, cut down to the fields
:class:`tether.plan.ModelShape` reads (``model_type``, ``vocab_size``, ``hidden_size``,
``intermediate_size``, ``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads``,
``head_dim`` where the file sets it, ``tie_word_embeddings``, the bias flags where the file sets
them, and ``torch_dtype``, the dtype a reward model loads in). Each entry is read by
:meth:`tether.plan.ModelShape.from_config` exactly as a ``config.json`` file with those fields
(``tests/test_plan.py`` writes every entry to a directory and compares).

``max_position_embeddings`` is left out: tether plan takes the sequence length from
``data.max_prompt_length`` and ``rollout.max_new_tokens``, and the base and -Instruct checkpoints
of one model differ in it (Qwen2.5-7B 131072, Qwen2.5-7B-Instruct 32768) while every field above is
the same in both.

Only ``tether plan`` accepts these names (a local directory of the same name wins); ``tether train``
needs a model directory with weights and never downloads one.
"""

from __future__ import annotations

__all__ = ["SHAPES", "SOURCES"]

SHAPES: dict[str, dict] = {}
"""Name (lower case) -> the ``config.json`` fields tether plan reads, as published."""

SOURCES: dict[str, str] = {}
"""Name -> the Hugging Face repository whose ``config.json`` the entry copies."""


def _shape(name: str, repo: str, **fields) -> None:
    SHAPES[name] = fields
    SOURCES[name] = repo


# Qwen2.5: https://huggingface.co/Qwen/Qwen2.5-<size>/blob/main/config.json (the -Instruct
# checkpoints have the same fields but max_position_embeddings). Qwen2 attention: q/k/v biases.
# Tied embeddings up to 3B; vocabulary 151936 up to 3B, 152064 from 7B. Parameter counts (these
# shapes, tether.plan's exact formula): 0.494, 1.544, 3.086, 7.616, 14.770, 32.764, 72.706 B; the
# model cards give 0.49, 1.54, 3.09, 7.61, 14.7, 32.5, 72.7 B.
_QWEN25 = dict(model_type="qwen2", torch_dtype="bfloat16")
_shape(
    "qwen2.5-0.5b",
    "Qwen/Qwen2.5-0.5B",
    **_QWEN25,
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    tie_word_embeddings=True,
)
_shape(
    "qwen2.5-1.5b",
    "Qwen/Qwen2.5-1.5B",
    **_QWEN25,
    vocab_size=151936,
    hidden_size=1536,
    intermediate_size=8960,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    tie_word_embeddings=True,
)
_shape(
    "qwen2.5-3b",
    "Qwen/Qwen2.5-3B",
    **_QWEN25,
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=11008,
    num_hidden_layers=36,
    num_attention_heads=16,
    num_key_value_heads=2,
    tie_word_embeddings=True,
)
_shape(
    "qwen2.5-7b",
    "Qwen/Qwen2.5-7B",
    **_QWEN25,
    vocab_size=152064,
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    tie_word_embeddings=False,
)
_shape(
    "qwen2.5-14b",
    "Qwen/Qwen2.5-14B",
    **_QWEN25,
    vocab_size=152064,
    hidden_size=5120,
    intermediate_size=13824,
    num_hidden_layers=48,
    num_attention_heads=40,
    num_key_value_heads=8,
    tie_word_embeddings=False,
)
_shape(
    "qwen2.5-32b",
    "Qwen/Qwen2.5-32B",
    **_QWEN25,
    vocab_size=152064,
    hidden_size=5120,
    intermediate_size=27648,
    num_hidden_layers=64,
    num_attention_heads=40,
    num_key_value_heads=8,
    tie_word_embeddings=False,
)
_shape(
    "qwen2.5-72b",
    "Qwen/Qwen2.5-72B",
    **_QWEN25,
    vocab_size=152064,
    hidden_size=8192,
    intermediate_size=29568,
    num_hidden_layers=80,
    num_attention_heads=64,
    num_key_value_heads=8,
    tie_word_embeddings=False,
)

# Qwen3: https://huggingface.co/Qwen/Qwen3-<size>/blob/main/config.json. head_dim 128 throughout
# (so heads x head_dim is not hidden_size: 8192 vs 5120 for 32B), no attention biases, an RMSNorm
# of each query and key head (q_norm, k_norm). Tied embeddings up to 4B. Parameter counts: 0.596,
# 1.721, 4.022, 8.191, 14.768, 32.762 B; the model cards give 0.6, 1.7, 4.0, 8.2, 14.8, 32.8 B.
_QWEN3 = dict(model_type="qwen3", torch_dtype="bfloat16", attention_bias=False, head_dim=128, vocab_size=151936)
_shape(
    "qwen3-0.6b",
    "Qwen/Qwen3-0.6B",
    **_QWEN3,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    tie_word_embeddings=True,
)
_shape(
    "qwen3-1.7b",
    "Qwen/Qwen3-1.7B",
    **_QWEN3,
    hidden_size=2048,
    intermediate_size=6144,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    tie_word_embeddings=True,
)
_shape(
    "qwen3-4b",
    "Qwen/Qwen3-4B",
    **_QWEN3,
    hidden_size=2560,
    intermediate_size=9728,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    tie_word_embeddings=True,
)
_shape(
    "qwen3-8b",
    "Qwen/Qwen3-8B",
    **_QWEN3,
    hidden_size=4096,
    intermediate_size=12288,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    tie_word_embeddings=False,
)
_shape(
    "qwen3-14b",
    "Qwen/Qwen3-14B",
    **_QWEN3,
    hidden_size=5120,
    intermediate_size=17408,
    num_hidden_layers=40,
    num_attention_heads=40,
    num_key_value_heads=8,
    tie_word_embeddings=False,
)
_shape(
    "qwen3-32b",
    "Qwen/Qwen3-32B",
    **_QWEN3,
    hidden_size=5120,
    intermediate_size=25600,
    num_hidden_layers=64,
    num_attention_heads=64,
    num_key_value_heads=8,
    tie_word_embeddings=False,
)

# Llama 3.x: https://huggingface.co/meta-llama/<name>/blob/main/config.json (gated; the -Instruct
# checkpoints have the same fields). Vocabulary 128256, 8 KV heads, no biases; 3.2's 1B and 3B
# set head_dim (64, 128) and tie their embeddings; 3.1 8B and 70B leave head_dim to hidden / heads
# (128). Llama-3.3-70B has Llama-3.1-70B's architecture. Parameter counts: 1.236, 3.213, 8.030,
# 70.554 B; the model cards give 1.23, 3.21, 8.03 and 70.6 B (Hugging Face's count for 70B).
_LLAMA3 = dict(
    model_type="llama",
    torch_dtype="bfloat16",
    attention_bias=False,
    mlp_bias=False,
    vocab_size=128256,
    num_key_value_heads=8,
)
_shape(
    "llama-3.2-1b",
    "meta-llama/Llama-3.2-1B",
    **_LLAMA3,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    head_dim=64,
    tie_word_embeddings=True,
)
_shape(
    "llama-3.2-3b",
    "meta-llama/Llama-3.2-3B",
    **_LLAMA3,
    hidden_size=3072,
    intermediate_size=8192,
    num_hidden_layers=28,
    num_attention_heads=24,
    head_dim=128,
    tie_word_embeddings=True,
)
_shape(
    "llama-3.1-8b",
    "meta-llama/Llama-3.1-8B",
    **_LLAMA3,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    tie_word_embeddings=False,
)
_shape(
    "llama-3.1-70b",
    "meta-llama/Llama-3.1-70B",
    **_LLAMA3,
    hidden_size=8192,
    intermediate_size=28672,
    num_hidden_layers=80,
    num_attention_heads=64,
    tie_word_embeddings=False,
)
_shape(
    "llama-3.3-70b",
    "meta-llama/Llama-3.3-70B-Instruct",
    **_LLAMA3,
    hidden_size=8192,
    intermediate_size=28672,
    num_hidden_layers=80,
    num_attention_heads=64,
    tie_word_embeddings=False,
)
