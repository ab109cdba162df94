"""Memory planning: per-device bytes of every role before a run starts, from ``config.json`` alone.

``tether plan CONFIG --devices N --device-memory 80GiB`` reads each model's ``config.json`` (the
actor's, and the reference, critic and reward models' where they differ; no weights are loaded),
or takes a named shape instead of a directory (``actor.model=qwen2.5-32b``: the published
``config.json`` fields of Qwen2.5, Qwen3 and Llama 3.x checkpoints, :mod:`tether.plan_shapes`),
counts the parameters from the architecture (Llama / Qwen2 / Qwen3 / Mistral-style decoders), and
adds up what each role keeps on one device:

* **weights** in ``actor.dtype`` (with ``actor.dtype=float32`` and a bfloat16 compute dtype these
  are the fp32 master weights), **gradients** and **AdamW's two moments**, sharded by FSDP2 over
  all ``N = dp × tp`` devices (dp data-parallel ranks, tp tensor-parallel ranks);
* the **compute copy** FSDP2 all-gathers in the compute dtype (the root unit, embeddings + LM head,
  and two transformer blocks: the one computing and the one prefetched), divided by tp;
* **activations** saved for the backward of one micro-batch, with and without activation
  checkpointing (:func:`activation_bytes_per_layer`);
* the **logits** of one micro-batch and the chunked log-prob buffers of
  :mod:`tether.algos.logprobs`;
* the frozen **reference** (weights only), the **critic** (a value model trained like the actor),
  the **reward model** and the validation's gold reward model ``reward.val_model`` (weights only, in
  their checkpoints' dtype) and the rollout engine, whose registry
  entry plans its own memory (``tether.engines``: HF ``generate``'s KV cache, or **vLLM**'s reservation,
  ``rollout.vllm.gpu_memory_utilization`` of the device or the weights plus ``rollout.vllm.kv_cache_gib``).

Phases run one after another (rollout, log-probs, critic update, actor update), so the peak is the
memory every phase keeps (weights, optimizer state, vLLM's reservation) plus the largest phase.
Every number is in bytes; the tables print GiB (2**30 bytes).

What is measured against what: ``benchmarks/plan_vs_measured.py`` compares these formulas with the
peak of live tensor bytes (``torch.distributed._tools.mem_tracker.MemTracker``) of the actor's real
training step on tiny Qwen2 models on CPU; the table is in ``docs/distributed.md``.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tether.algos.distill import DIVERGENCE_CHUNK_TEMPORARIES, FULL_DISTILL_ESTIMATORS
from tether.algos.logprobs import DEFAULT_CHUNK_ELEMENTS
from tether.config import EMBEDDED, EXACT_TEACHER, ConfigError, load_config
from tether.engines import ENGINES, entry, fallback, planned_engine
from tether.models import resolve_model_path
from tether.plan_shapes import SHAPES

__all__ = [
    "DTYPE_BYTES",
    "ModelShape",
    "resolve_shape",
    "PlanSettings",
    "Plan",
    "activation_bytes",
    "activation_bytes_per_layer",
    "logits_bytes",
    "full_logits_bytes",
    "parse_size",
    "plan_memory",
    "plan_config",
    "suggestions",
    "format_plan",
    "main_plan",
]

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
GIB = 1 << 30

_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_COUNTS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
"""config.json fields that must be positive integers (the library's default where the file leaves one out)."""
_OPTIONAL_COUNTS = ("num_key_value_heads", "head_dim", "num_labels")
"""Positive integers where given; null or absent means the default (all heads, hidden // heads, 1)."""
_FLAGS = ("tie_word_embeddings", "attention_bias", "mlp_bias")


def _check_fields(values: dict, where: str) -> None:
    """Check the config.json fields :class:`ModelShape` reads before anything divides by them.

    Raises:
        ValueError: one line naming ``where`` (the config.json path) and the first bad field: a count
            that is not a positive integer (0, a string, a float, true/false), a flag that is not
            true/false, a dtype that is not a string, or KV heads that do not divide the heads.
    """
    for k in _COUNTS + _OPTIONAL_COUNTS:
        if k not in values or (values[k] is None and k in _OPTIONAL_COUNTS):
            continue
        v = values[k]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{where}: {k} must be a positive integer, got {v!r}")
    for k in _FLAGS:
        if k in values and not isinstance(values[k], bool):
            raise ValueError(f"{where}: {k} must be true or false, got {values[k]!r}")
    for k in ("torch_dtype", "dtype"):
        if values.get(k) is not None and not isinstance(values[k], str):
            raise ValueError(f'{where}: {k} must be a dtype name such as "bfloat16", got {values[k]!r}')
    heads, kv = values.get("num_attention_heads"), values.get("num_key_value_heads")
    if isinstance(heads, int) and isinstance(kv, int) and heads % kv:
        raise ValueError(f"{where}: num_key_value_heads ({kv}) must divide num_attention_heads ({heads})")


def parse_size(text: str) -> int:
    """Bytes from ``"80GiB"``, ``"141GB"``, ``"80G"`` (G = GiB), ``"512MiB"`` or a plain number of bytes.

    Raises:
        ValueError: not a positive size with a known unit (names the text).
    """
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(i?B?)\s*", str(text), flags=re.IGNORECASE)
    if not m:
        raise ValueError(f"device memory {text!r} is not a size such as 80GiB, 141GB or 512MiB")
    value, prefix, suffix = float(m.group(1)), m.group(2).upper(), m.group(3).lower()
    power = "KMGT".index(prefix) + 1 if prefix else 0
    base = 1000 if suffix == "b" and prefix else 1024  # "GB" is 10**9; "G" and "GiB" are 2**30
    size = int(value * base**power)
    if size <= 0:
        raise ValueError(f"device memory {text!r} must be positive")
    return size


@dataclass(frozen=True)
class ModelShape:
    """The architecture numbers of a decoder-only LM (Llama / Qwen2 / Qwen3 / Mistral style).

    ``head_dim`` is the per-head width (``hidden // heads`` unless the config sets it). Biases:
    Qwen2 has q/k/v biases; Llama's and Qwen3's ``attention_bias`` adds them to q/k/v/o and Llama's
    ``mlp_bias`` to the MLP; Mistral has none. ``qk_norm``: Qwen3's RMSNorm of each query and key
    head (``q_norm``, ``k_norm``: head_dim weights each). ``dtype`` is the checkpoint's
    ``torch_dtype`` (what a reward model loads in on a GPU with ``dtype="auto"``).
    """

    model_type: str
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    tied: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    dtype: str = "float32"
    num_labels: int = 1
    qk_norm: bool = False

    @classmethod
    def from_config(cls, source: str | Path | dict, *, where: str | None = None) -> ModelShape:
        """Read a model directory's ``config.json`` (or a dict of its fields: a named shape of
        :mod:`tether.plan_shapes`) through ``transformers.AutoConfig``, so defaults the file leaves
        out (``tie_word_embeddings``, ``head_dim``) are the library's. A dict goes through the same
        steps as the file. ``where`` names the source in errors (default: the config.json path, or
        ``"config"`` for a dict).

        Raises:
            ValueError: one line naming the config.json path (or ``where``) and the field: no
                config.json, not a JSON object, a count that is not a positive integer (zero heads,
                ``"hidden_size": "big"``), a flag that is not true/false, KV heads that do not divide
                the heads, a config transformers refuses, or an architecture without the fields above.
        """
        if isinstance(source, dict):
            raw, where = dict(source), where or "config"
        else:
            p = Path(source)
            f = p / "config.json"
            if not f.is_file():
                raise ValueError(f"{p}: no config.json (tether plan reads the architecture from it)")
            where = where or str(f)
            try:
                raw = json.loads(f.read_text())
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise ValueError(f"{where}: not valid JSON ({e})") from None
            if not isinstance(raw, dict):
                raise ValueError(f"{where}: holds a JSON {type(raw).__name__}, not an object of config fields")
        _check_fields(raw, where)
        if "torch_dtype" in raw:  # the name before transformers 5
            raw.setdefault("dtype", raw.pop("torch_dtype"))
        from transformers import CONFIG_MAPPING, AutoConfig, PretrainedConfig

        mt = raw.pop("model_type", None)
        if mt is not None and (not isinstance(mt, str) or mt not in CONFIG_MAPPING):
            raise ValueError(
                f"{where}: model_type {mt!r} is no transformers architecture; tether plan knows "
                "Llama/Qwen2/Qwen3/Mistral-style decoders"
            )
        try:
            cfg = AutoConfig.for_model(mt, **raw) if mt is not None else PretrainedConfig(**raw)
        except Exception as e:  # a field the config class's own checks refuse (transformers 5's strict dataclasses)
            msg = " ".join(str(e).split())
            raise ValueError(
                f"{where}: transformers cannot read it: {type(e).__name__}: "
                f"{msg[:300]}{'...' if len(msg) > 300 else ''}"
            ) from None
        return cls.from_hf(cfg, where=where)

    @classmethod
    def from_hf(cls, cfg, *, where: str | None = None) -> ModelShape:
        """From a ``transformers`` config object. ``where`` names it in errors (default its model_type).

        Raises:
            ValueError: a missing field, or one that is not a positive integer / true or false
                (one line naming ``where`` and the field).
        """
        where = where or f"model_type {getattr(cfg, 'model_type', '?')!r}"
        missing = [k for k in _COUNTS if getattr(cfg, k, None) is None]
        if missing:
            raise ValueError(
                f"{where}: config has no {', '.join(missing)}; tether plan knows Llama/Qwen2/Qwen3/Mistral-style "
                "decoders"
            )
        _check_fields({k: getattr(cfg, k) for k in _COUNTS + _OPTIONAL_COUNTS + _FLAGS if hasattr(cfg, k)}, where)
        mt = cfg.model_type
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        dtype = str(getattr(cfg, "dtype", None) or "float32").removeprefix("torch.")  # config.json's torch_dtype
        attention_bias = bool(getattr(cfg, "attention_bias", False))
        return cls(
            model_type=mt,
            vocab=cfg.vocab_size,
            hidden=cfg.hidden_size,
            layers=cfg.num_hidden_layers,
            heads=heads,
            kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            intermediate=cfg.intermediate_size,
            tied=bool(getattr(cfg, "tie_word_embeddings", False)),
            qkv_bias=mt == "qwen2" or attention_bias,
            o_bias=attention_bias,
            mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
            dtype=dtype if dtype in DTYPE_BYTES else "float32",
            num_labels=int(getattr(cfg, "num_labels", 1) or 1),
            qk_norm=mt == "qwen3",
        )

    # ---- parameter counts (exact, as ``sum(p.numel() for p in model.parameters())``)
    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def block_params(self) -> int:
        """One decoder layer: q/k/v/o projections (GQA: k and v have kv_heads), SwiGLU MLP, two RMSNorms
        (and Qwen3's per-head query and key norms)."""
        h, q, kv, i = self.hidden, self.q_dim, self.kv_dim, self.intermediate
        attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if self.qkv_bias else 0) + (h if self.o_bias else 0)
        mlp = 3 * h * i + (2 * i + h if self.mlp_bias else 0)
        return attn + mlp + self.block_norm_params()

    def block_norm_params(self) -> int:
        """The RMSNorm weights of one decoder layer: 2·h, plus 2·head_dim with ``qk_norm``."""
        return 2 * self.hidden + (2 * self.head_dim if self.qk_norm else 0)

    def backbone_params(self) -> int:
        """Embeddings, the layers and the final norm (``AutoModel``: the critic's and reward model's trunk)."""
        return self.vocab * self.hidden + self.layers * self.block_params() + self.hidden

    def causal_lm_params(self) -> int:
        """``AutoModelForCausalLM``: the backbone plus an LM head (V·h) unless tied to the embeddings."""
        return self.backbone_params() + (0 if self.tied else self.vocab * self.hidden)

    def value_model_params(self) -> int:
        """tether's ``ValueModel``: the backbone plus ``Linear(h, 1)`` with bias."""
        return self.backbone_params() + self.hidden + 1

    def reward_model_params(self) -> int:
        """``AutoModelForSequenceClassification``: the backbone plus ``score = Linear(h, num_labels, bias=False)``."""
        return self.backbone_params() + self.hidden * self.num_labels

    def root_params(self) -> int:
        """What FSDP2's root unit holds: embeddings, final norm and (untied) LM head."""
        return self.causal_lm_params() - self.layers * self.block_params()

    def lora_params(self, rank: int, targets: str | list[str] = "all-linear") -> int:
        """peft LoRA adapters A (r × in) and B (out × r) on the targeted projections of every layer
        (``all-linear``: every Linear but the LM head)."""
        h, q, kv, i = self.hidden, self.q_dim, self.kv_dim, self.intermediate
        dims = {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }
        names = (
            _LINEARS
            if targets == "all-linear"
            else [
                n
                for n in _LINEARS
                if any(t == n or n.endswith(t) for t in ([targets] if isinstance(targets, str) else targets))
            ]
        )
        return self.layers * sum(rank * (dims[n][0] + dims[n][1]) for n in names)

    def rank_largest(self, rank: int) -> int:
        """Elements of the largest LoRA adapter matrix (r × max(h, I))."""
        return rank * max(self.hidden, self.intermediate)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """KV cache bytes per token: layers × (K and V) × kv_heads × head_dim × dtype bytes."""
        return self.layers * 2 * self.kv_dim * dtype_bytes


def activation_bytes_per_layer(
    shape: ModelShape, b: int, s: int, e: int, tp: int = 1, *, autocast: bool = False
) -> int:
    """Bytes one decoder layer saves for its backward, for a micro-batch of b sequences of s tokens.

    Counted tensor by tensor, as Korthikanti et al. 2022 ("Reducing Activation Recomputation in
    Large Transformer Models", §4.1, their 34·s·b·h + 5·a·s²·b for GPT) do, but for the layer
    Hugging Face runs (pre-RMSNorm, GQA, SDPA without dropout, SwiGLU), compute dtype of e bytes:

    * each RMSNorm: its input upcast to float32 (4 bytes per element of b·s·h; the input itself
      in a float32 model), the normalised value in the compute dtype (e) that the weight multiplies,
      and the weighted output the next projections save (e): b·s·h·(4 + 2e), twice per layer
      (plus the float32 rsqrt of the variance, b·s·4);
    * attention: q, and k, v repeated to all heads (``repeat_kv``: SDPA gets a padding mask, so no
      grouped-query kernel), and the attention output (SDPA's, which o_proj saves as its input):
      4·b·s·heads·head_dim·e, plus SDPA's float32 logsumexp b·heads·s·4 (a fused kernel: no s²
      probabilities), plus the (b, 1, s, s) additive padding mask each layer's SDPA keeps in e
      bytes (b·s²·e: a separate copy per layer, as measured on CPU);
    * the SwiGLU MLP: gate (SiLU's input), SiLU(gate), up and their product (down_proj's input):
      4·b·s·I·e;
    * with ``qk_norm`` (Qwen3), each query and key head's RMSNorm: its float32 input and normalised
      value, b·s·(heads + kv_heads)·head_dim·(4 + e), plus the float32 rsqrt per head and position,
      b·s·(heads + kv_heads)·4 (RoPE, which takes the norm's output, saves nothing of that size).

    Checked tensor by tensor with ``torch.autograd.graph.saved_tensors_hooks`` on tiny Qwen2, Llama
    and Qwen3 models (tests/test_plan.py).

    ``autocast`` (``actor.compute_dtype=bfloat16`` over float32 weights): the norms keep their
    input and normalised value in float32 and each projection saves its own e-byte cast of the
    norm's output (q, k, v: three; gate, up: two): b·s·h·(16 + 5e) per layer.

    With tensor and sequence parallelism of degree tp every term is split tp ways (Korthikanti et
    al. 2022, eq. 5, with sequence parallelism). Returns bytes on one device.
    """
    h, i, q = shape.hidden, shape.intermediate, shape.q_dim
    if autocast:  # float32 x and normalised value per norm; each projection saves its own cast of the output
        norms = b * s * h * (16 + 5 * e) + 2 * b * s * 4
    else:
        norms = 2 * b * s * (h * (4 + 2 * e) + 4)  # + the float32 rsqrt(variance), one per position
    attn = b * s * 4 * q * e + b * shape.heads * s * 4 + b * s * s * e  # + the layer's (b, 1, s, s) mask in e bytes
    if shape.qk_norm:  # Qwen3: fp32 input, normalised value and fp32 rsqrt of each q and k head's RMSNorm
        attn += b * s * (q + shape.kv_dim) * (4 + e) + b * s * (shape.heads + shape.kv_heads) * 4
    mlp = 4 * b * s * i * e
    return math.ceil((norms + attn + mlp) / tp)


def activation_bytes(
    shape: ModelShape, b: int, s: int, e: int, *, checkpointing: bool, tp: int = 1, autocast: bool = False
) -> int:
    """Activations saved over the whole forward of one micro-batch (b sequences, s tokens), bytes.

    Without checkpointing: every layer's :func:`activation_bytes_per_layer`, plus the final norm
    (b·s·(h·(4 + 2e) + 4)). With per-layer checkpointing: each layer keeps only its input (b·s·h·e) and
    one layer's activations are rebuilt at a time in the backward (Korthikanti et al. 2022, §4.3,
    "full recomputation": 2·s·b·h per layer in fp16, plus one layer).
    """
    # autocast: the fp32 LM head saves fp32
    final_norm = b * s * (shape.hidden * (12 if autocast else (4 + 2 * e)) + 4) // tp
    per_layer = activation_bytes_per_layer(shape, b, s, e, tp, autocast=autocast)
    if checkpointing:
        return shape.layers * b * s * shape.hidden * e // tp + per_layer + final_norm
    return shape.layers * per_layer + final_norm


def logits_bytes(
    shape: ModelShape, b: int, t: int, e: int, *, tp: int = 1, accelerator: bool = True, train: bool = True
) -> int:
    """Peak bytes of the LM head's output and the log-prob computation for one micro-batch.

    The LM head runs on the t positions that score a response token only (``logits_to_keep``,
    :func:`tether.models.response_logprobs`): (b, t, V) logits of e bytes each (4 with
    ``actor.compute_dtype=bfloat16``, whose LM head stays float32; else the compute dtype).
    :func:`tether.algos.logprobs_and_entropy_from_logits` reads the (b, t, V) slice in chunks of at
    most ``DEFAULT_CHUNK_ELEMENTS`` logits (2**24 on an accelerator, 2**22 on a CPU), in float32.
    Without grad: the logits and about three chunk temporaries. In training the backward first holds
    the logits, the (b, t, V) gradient it builds and two chunk temporaries (log p and p); then the
    (b, t, V) gradient of the kept logits and the LM head's (V, h) weight gradient: the larger of
    the two. Vocabulary-parallel (tp) splits V. Measured on CPU against ``MemTracker``
    (``benchmarks/plan_vs_measured.py``).
    """
    v = math.ceil(shape.vocab / tp)
    chunk = min(DEFAULT_CHUNK_ELEMENTS["accelerator" if accelerator else "cpu"], b * t * v) * 4  # float32 bytes
    logits = b * t * v * e
    if not train:
        return logits + 3 * chunk
    return max(logits + b * t * v * e + 2 * chunk, logits + shape.hidden * v * e)


FULL_KL_CHUNK_BYTES = 12
"""Bytes per chunk element of :func:`tether.algos.kl_full`'s forward (``_FullKL``): log p, then the other model's
scaled logits and their log-softmax turned in place into log p − log q: three float32 chunks at most, as many as the
log-prob pass's (:func:`logits_bytes`)."""


def full_logits_bytes(
    shape: ModelShape,
    b: int,
    t: int,
    e: int,
    estimator: str,
    *,
    tp: int = 1,
    accelerator: bool = True,
    train: bool = False,
) -> int:
    """Bytes one micro-batch adds, beyond :func:`logits_bytes`, for a full-vocabulary divergence to a frozen model's
    logits: ``estimator`` ``"kl_full"`` (``kl.estimator=full``, the reference) or one of
    :data:`tether.algos.FULL_DISTILL_ESTIMATORS` (``distill.estimator``, the teacher).

    With n = b·t·V' elements (V' = ceil(V / tp)) and a chunk of c = min(``DEFAULT_CHUNK_ELEMENTS``, n) elements, d
    bytes per chunk element (:data:`FULL_KL_CHUNK_BYTES` = 12 for ``kl_full``; 4·D + 1 for a divergence, D float32
    temporaries of :data:`tether.algos.distill.DIVERGENCE_CHUNK_TEMPORARIES`, 9 for reverse and forward, 10 for jsd,
    and a bool mask):

    * without grad (``train=False``, the log-prob pass, ``tether.workers.actor._forward_logprobs``): the frozen
      model's (b, t, V') logits in float32 (``.float()``), 4n; a float32 copy of the student's logits, 4n more, when
      they are not float32 (e ≠ 4); and the chunk temporaries beyond the log-prob pass's three float32 ones
      (:func:`logits_bytes` counts those, freed before): max(0, d − 12)·c;
    * in training (``train=True``, the update with the KL loss or the distillation term): the frozen logits saved for
      the backward, e·n, the (b, t, V') gradient the term's backward builds for the student's logits, e·n, and the
      backward's recomputed chunk with its gradients, 2·d·c: 2·e·n + 2·d·c.

    ``top_k`` only makes a divergence's chunk smaller; it is counted at the full vocabulary.

    Raises:
        ValueError: an unknown ``estimator`` (names the valid ones).
    """
    if estimator == "kl_full":
        d = FULL_KL_CHUNK_BYTES
    elif estimator in FULL_DISTILL_ESTIMATORS:
        d = 4 * DIVERGENCE_CHUNK_TEMPORARIES[estimator] + 1
    else:
        raise ValueError(
            f"full_logits_bytes: unknown estimator {estimator!r}; use kl_full or one of "
            f"{', '.join(FULL_DISTILL_ESTIMATORS)}"
        )
    n = b * t * math.ceil(shape.vocab / tp)
    c = min(DEFAULT_CHUNK_ELEMENTS["accelerator" if accelerator else "cpu"], n)
    if train:
        return 2 * e * n + 2 * d * c
    return 4 * n + (4 * n if e != 4 else 0) + max(0, d - 3 * 4) * c


@dataclass(frozen=True)
class PlanSettings:
    """Everything the plan depends on besides the model shapes (from the config and ``tether plan``'s flags).

    ``devices`` is the number of devices the roles are spread over (dp × tp; FSDP2 shards over all
    of them); ``device_memory`` bytes each; ``gpus_per_node`` for the host memory of CPU offload.
    """

    devices: int = 1
    device_memory: int = 80 * GIB
    gpus_per_node: int = 8
    tp: int = 1
    storage_dtype: str = "float32"
    compute_dtype: str = "float32"
    offload: bool = False
    actor_checkpointing: bool = False
    critic_checkpointing: bool = False
    accumulates: bool = False
    actor_micro_batch: int = 1
    critic_micro_batch: int = 1
    logprob_micro_batch: int = 1
    prompt_len: int = 512
    response_len: int = 4
    rollout_batch: int = 1
    lora_rank: int = 0
    lora_targets: str | list[str] = "all-linear"
    separate_ref: bool = True
    critic: bool = False
    reward_model: bool = False
    engine: str = field(default_factory=lambda: fallback().name)
    rollout_tp: int | None = None
    #: each engine's settings section as a dict (``{"vllm": {"gpu_memory_utilization": 0.35, ...}}``), what its
    #: plan hook reads (``tether.engines``); an engine missing here plans with its defaults
    engine_settings: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    autocast: bool = False
    accelerator: bool = True
    #: ``kl.estimator=full``: the reference's logits in the log-prob pass; ``kl_full_loss``: also in the update (the
    #: KL loss's estimator is ``full``)
    kl_full: bool = False
    kl_full_loss: bool = False
    #: ``distill.estimator`` when it is a full-vocabulary one with a teacher (reverse, forward, jsd); None otherwise
    distill_estimator: str | None = None

    @property
    def storage_bytes(self) -> int:
        return DTYPE_BYTES[self.storage_dtype]

    @property
    def compute_bytes(self) -> int:
        return DTYPE_BYTES[self.compute_dtype]

    @property
    def dp(self) -> int:
        return self.devices // self.tp

    @property
    def node_devices(self) -> int:
        """Devices of one node the plan uses: ``devices``, at most ``gpus_per_node``."""
        return min(self.devices, self.gpus_per_node)

    @property
    def engine_tp(self) -> int:
        """The rollout engine's tensor-parallel size (``--rollout-tp``, else its section's ``tensor_parallel_size``,
        ``rollout.vllm.tensor_parallel_size``, when the config sets it; default the training tp)."""
        return self.rollout_tp or self.tp

    @classmethod
    def from_config(
        cls,
        cfg,
        *,
        devices: int = 1,
        device_memory: int = 80 * GIB,
        tp_size: int | None = None,
        offload: bool | None = None,
        param_dtype: str | None = None,
        gpus_per_node: int | None = None,
        activation_checkpointing: bool | None = None,
        rollout_tp: int | None = None,
        accelerator: bool = True,
    ) -> PlanSettings:
        """Read a :class:`tether.config.TetherConfig`; flags given here override it.

        Keys read: ``actor.dtype``, ``actor.micro_batch_size``, ``actor.gradient_checkpointing``,
        ``actor.lora.*``, ``actor.tp_size`` (when the config has it), ``critic.micro_batch_size``,
        ``ref.model``, ``reward.model``, ``algo.adv_estimator``, ``algo.mini_batch_size``,
        ``data.batch_size``, ``data.max_prompt_length``, ``rollout.n``, ``rollout.max_new_tokens``,
        ``rollout.engine``, ``rollout.vllm.*`` (``tensor_parallel_size``, when set, is the rollout's
        tp unless ``rollout_tp`` is given), ``kl.estimator``, ``kl.loss_estimator``, ``kl.placement``,
        ``distill.teacher``, ``distill.estimator`` and, from the Ray backend, ``trainer.fsdp.param_dtype``,
        ``trainer.fsdp.cpu_offload``, ``trainer.fsdp.activation_checkpointing`` and
        ``trainer.n_gpus_per_node``.

        Raises:
            ValueError: devices < 1, or tp that does not divide the devices (names both).
        """
        fsdp = getattr(cfg.trainer, "fsdp", None)
        tp = tp_size if tp_size is not None else int(getattr(cfg.actor, "tp_size", 1) or 1)
        if devices < 1 or tp < 1 or devices % tp:
            raise ValueError(f"--devices {devices} must be a positive multiple of the tensor-parallel size {tp}")
        dp = devices // tp
        storage = cfg.actor.dtype
        fsdp_dtype = param_dtype or (getattr(fsdp, "param_dtype", None) if fsdp is not None else None)
        # torch.autocast over actor.dtype weights (main's actor.compute_dtype)
        amp = getattr(cfg.actor, "compute_dtype", "float32")
        autocast = fsdp_dtype is None and amp != "float32" and amp != storage
        compute = fsdp_dtype or (amp if autocast else storage)
        ac = bool(getattr(fsdp, "activation_checkpointing", False)) if fsdp is not None else False
        if activation_checkpointing is not None:
            ac = activation_checkpointing
        mini = max(1, math.ceil(cfg.algo.mini_batch_size / dp))
        rollout_batch = cfg.data.batch_size * cfg.rollout.n
        engine = planned_engine(
            cfg.rollout.engine,
            accelerator,
            async_steps=cfg.rollout.async_steps,
            on_ray=getattr(cfg.trainer, "backend", "local") == "ray",
        )
        if rollout_tp is not None:
            _check_rollout_tp(cfg, engine, rollout_tp)
        sections = {name: getattr(cfg.rollout, name) for name, e in ENGINES.items() if e.section is not None}
        # devices per engine replica: the planned engine's tensor_parallel_size, else another section's that has one
        with_tp = [name for name, v in sections.items() if "tensor_parallel_size" in type(v).model_fields]
        tp_section = sections.get(engine if engine in with_tp else next(iter(with_tp), None))
        if (
            rollout_tp is None
            and tp_section is not None
            and ("tensor_parallel_size" in tp_section.model_fields_set or tp_section.tensor_parallel_size > 1)
        ):
            rollout_tp = tp_section.tensor_parallel_size  # devices per engine replica (trainer.backend=ray)
        return cls(
            devices=devices,
            device_memory=device_memory,
            tp=tp,
            storage_dtype=storage,
            compute_dtype=compute,
            gpus_per_node=gpus_per_node or int(getattr(cfg.trainer, "n_gpus_per_node", 0) or 8),
            offload=bool(
                offload if offload is not None else (getattr(fsdp, "cpu_offload", False) if fsdp is not None else False)
            ),
            actor_checkpointing=ac
            if activation_checkpointing is not None
            else (cfg.actor.gradient_checkpointing or ac),
            critic_checkpointing=ac,
            accumulates=mini > min(cfg.actor.micro_batch_size, cfg.critic.micro_batch_size),
            actor_micro_batch=min(cfg.actor.micro_batch_size, mini),
            critic_micro_batch=min(cfg.critic.micro_batch_size, mini),
            logprob_micro_batch=min(cfg.actor.micro_batch_size, max(1, math.ceil(rollout_batch / dp))),
            prompt_len=cfg.data.max_prompt_length,
            response_len=cfg.rollout.max_new_tokens,
            rollout_batch=rollout_batch,
            lora_rank=cfg.actor.lora.rank,
            lora_targets=cfg.actor.lora.target_modules,
            separate_ref=cfg.actor.lora.rank == 0,
            critic=cfg.algo.adv_estimator == "gae",
            reward_model=cfg.reward.model is not None,
            autocast=autocast,
            engine=engine,
            rollout_tp=rollout_tp,
            engine_settings={name: v.model_dump() for name, v in sections.items()},
            accelerator=accelerator,
            kl_full=cfg.kl.estimator == "full",
            kl_full_loss=cfg.kl.placement in ("loss", "both") and cfg.kl_loss_estimator == "full",
            distill_estimator=(
                cfg.distill.estimator
                if cfg.distill.teacher is not None and cfg.distill.estimator in FULL_DISTILL_ESTIMATORS
                else None
            ),
        )


def _check_rollout_tp(cfg, engine: str, rollout_tp: int) -> None:
    """``--rollout-tp`` sizes the tensor parallelism of a rollout engine's own replicas: refused where the plan has
    none, naming why (the local backend runs one engine in its process; an engine whose settings have no
    ``tensor_parallel_size`` generates on the actor's module, at the training tp).

    Raises:
        ValueError: one line naming ``--rollout-tp`` and the key that rules it out.
    """
    if rollout_tp < 1:
        raise ValueError(f"--rollout-tp {rollout_tp} must be at least 1")
    if getattr(cfg.trainer, "backend", "local") != "ray":
        raise ValueError(
            f"--rollout-tp {rollout_tp} needs trainer.backend=ray: a rollout engine's own tensor parallelism runs in "
            "Ray replicas, and the local backend runs one engine in its own process; set trainer.backend=ray or drop "
            "--rollout-tp"
        )
    section = ENGINES[engine].section
    if section is None or "tensor_parallel_size" not in section.model_fields:
        picked = f" (what rollout.engine={cfg.rollout.engine} plans here)" if cfg.rollout.engine != engine else ""
        own = [
            n for n, e in ENGINES.items() if e.section is not None and "tensor_parallel_size" in e.section.model_fields
        ]
        raise ValueError(
            f"--rollout-tp {rollout_tp} with rollout.engine={engine}{picked}: it has no tensor parallelism of its own "
            "(it generates on the actor's module, split as the actor is: --tp-size); drop --rollout-tp, or plan "
            + " or ".join(f"rollout.engine={n}" for n in own)
        )


@dataclass(frozen=True)
class Item:
    """One row of a plan: ``bytes`` on one device (``host`` bytes per node when offloaded).

    ``phase`` is ``"always"`` (kept through the step) or the phase that needs it transiently.
    """

    role: str
    what: str
    bytes: int
    phase: str = "always"
    host: int = 0
    note: str = ""


@dataclass
class Plan:
    """Per-device memory of every role, the peak and the verdict. Bytes; see :func:`plan_memory`."""

    settings: PlanSettings
    items: list[Item]
    params: dict[str, int]
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    suggestions: list[tuple[str, int, int, tuple[str, ...]]] = field(default_factory=list)
    combined: list[tuple[str, int, int]] = field(default_factory=list)

    @property
    def persistent(self) -> int:
        return sum(i.bytes for i in self.items if i.phase == "always")

    def phase_bytes(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for i in self.items:
            if i.phase != "always":
                out[i.phase] = out.get(i.phase, 0) + i.bytes
        return out

    @property
    def peak_phase(self) -> str:
        phases = self.phase_bytes()
        return max(phases, key=phases.get) if phases else "always"

    @property
    def peak(self) -> int:
        """Bytes on one device at the step's peak: what every phase keeps plus the largest phase."""
        return self.persistent + max(self.phase_bytes().values(), default=0)

    @property
    def host_per_node(self) -> int:
        return sum(i.host for i in self.items) * self.settings.node_devices

    @property
    def fits(self) -> bool:
        """The peak is within the device's memory and nothing else rules the run out (``problems``)."""
        return self.peak <= self.settings.device_memory and not self.problems

    @property
    def headroom(self) -> int:
        return self.settings.device_memory - self.peak


def _trained_role(
    role: str,
    shape: ModelShape,
    n_params: int,
    n_train: int,
    s: PlanSettings,
    micro: int,
    ckpt: bool,
    lm: bool,
    accumulates: bool,
) -> list[Item]:
    """Items of a trained role (actor or critic) on one device. See the module docstring.

    Phases: ``backward`` (the saved activations, the logits and their gradient, FSDP2's gathered
    units; plus the gradients when a mini-batch spans several micro-batches, since they accumulate)
    and ``optimizer step`` (the gradients and AdamW's temporaries).
    """
    es, ec = DTYPE_BYTES[s.storage_dtype], DTYPE_BYTES[s.compute_dtype]
    n = s.devices
    lora = n_train != n_params
    et = 4 if lora else es  # peft adapters are float32
    weights = ((n_params - n_train) * es + n_train * et) // n
    grads = n_train * et // n
    adam = 2 * n_train * et // n
    where = "host" if s.offload else "device"
    master = "fp32 master weights" if es == 4 and ec < 4 else f"weights ({s.storage_dtype})"
    back, step = f"{role} backward", f"{role} optimizer step"
    items = []
    for what, b, ph in (
        (master, weights, "always"),
        (f"AdamW moments ({'float32' if lora else s.storage_dtype})", adam, "always"),
        ("gradients", grads, step),
    ):
        items.append(
            Item(
                role,
                what + (" [offloaded]" if s.offload else ""),
                0 if s.offload else b,
                ph,
                host=b if s.offload else 0,
                note=f"sharded over {n} devices, on the {where}",
            )
        )
    if accumulates and not s.offload:
        items.append(
            Item(
                role,
                "gradients accumulated over micro-batches",
                grads,
                back,
                note="a mini-batch of several micro-batches",
            )
        )
    if not s.offload:
        largest = (
            shape.rank_largest(s.lora_rank)
            if lora
            else max(shape.vocab * shape.hidden, shape.hidden * shape.intermediate)
        )
        temp = n_train * et // n if s.accelerator else 2 * largest * et
        items.append(
            Item(
                role,
                "AdamW step temporaries",
                temp,
                step,
                note="foreach AdamW: one tensor per parameter (GPU); the CPU loop: two of the largest tensor",
            )
        )
    amp = s.autocast and lm  # the critic runs without autocast
    if amp:
        casts = shape.layers * (shape.block_params() - shape.block_norm_params()) * ec // s.tp
        items.append(
            Item(
                role,
                f"autocast {s.compute_dtype} copies of the layers' weights",
                casts,
                back,
                note="torch.autocast caches one cast per weight through the forward; the backward keeps them",
            )
        )
    elif n > 1 or (ec != es and not s.autocast) or s.offload:
        units = (
            (shape.root_params() + 2 * shape.block_params())
            if lm
            else (shape.value_model_params() - (shape.layers - 2) * shape.block_params())
        )
        items.append(
            Item(
                role,
                f"compute copy ({s.compute_dtype}, root + 2 blocks)",
                units * ec // s.tp,
                back,
                note="FSDP2 all-gathered units, freed after each block (reshard_after_forward)",
            )
        )
        items.append(
            Item(
                role,
                "unsharded grads of the gathered units",
                units * ec // s.tp,
                back,
                note="before the reduce-scatter",
            )
        )
    seq = s.prompt_len + s.response_len - 1  # the last response token is only scored, never fed
    ea = ec if (amp or not s.autocast) else es  # an autocast run's critic computes in actor.dtype
    act_on = activation_bytes(shape, micro, seq, ea, checkpointing=True, tp=s.tp, autocast=amp)
    act_off = activation_bytes(shape, micro, seq, ea, checkpointing=False, tp=s.tp, autocast=amp)
    layer = activation_bytes_per_layer(shape, micro, seq, ea, s.tp, autocast=amp)
    what = f"activations (micro-batch {micro} × {seq} tokens, checkpointing {'on' if ckpt else 'off'})"
    note = f"with checkpointing {act_on / GIB:.2f} GiB, without {act_off / GIB:.2f} GiB"
    if not lm:
        items.append(Item(role, what, act_on if ckpt else act_off, back, note=note))
        return items
    logits = logits_bytes(shape, micro, s.response_len, 4 if amp else ec, tp=s.tp, accelerator=s.accelerator)
    if ckpt:
        # the layer inputs are kept; the logits' backward is over before the first layer is recomputed
        items.append(Item(role, what.replace("activations", "layer inputs"), act_on - layer, back, note=note))
        items.append(
            Item(
                role,
                "logits + log-prob chunks, or one recomputed layer",
                max(logits, layer),
                back,
                note=f"the larger of {logits / GIB:.2f} and {layer / GIB:.2f} GiB",
            )
        )
    else:
        items.append(Item(role, what, act_off, back, note=note))
        items.append(
            Item(
                role,
                "logits + log-prob chunks (backward)",
                logits,
                back,
                note="(b, P+T, V) logits with the (b, T, V) gradient, or the (b, P+T, V) one and the LM head's",
            )
        )
    return items


def plan_memory(
    settings: PlanSettings,
    actor: ModelShape,
    *,
    ref: ModelShape | None = None,
    critic: ModelShape | None = None,
    reward: ModelShape | None = None,
    val_reward: ModelShape | None = None,
    teacher: ModelShape | None = None,
) -> Plan:
    """Per-device memory of one training step with every role colocated on each device (verl's hybrid engine).

    Args:
        settings: see :class:`PlanSettings`.
        actor: the policy's shape; ``ref``/``critic``/``reward`` default to it (reward: only when
            ``settings.reward_model``).
        val_reward: the shape of ``reward.val_model``, the validation's gold reward model, loaded at start-up and
            kept through the run like the reward model (weights only); None = no such model.
        teacher: the shape of ``distill.teacher``, the frozen teacher of on-policy distillation, counted as a
            separate reference is (weights in ``actor.dtype``, no optimizer); None = distillation off.

    Returns:
        A :class:`Plan`; its ``peak`` is bytes on one device, ``fits`` compares it with
        ``settings.device_memory``.
    """
    s = settings
    ref, critic_shape = ref or actor, critic or actor
    ec = DTYPE_BYTES[s.compute_dtype]
    n = s.devices
    p_actor = actor.causal_lm_params()
    p_train = actor.lora_params(s.lora_rank, s.lora_targets) if s.lora_rank else p_actor
    params = {"actor": p_actor, "actor (trained)": p_train}
    items = _trained_role(
        "actor",
        actor,
        p_actor + (p_train if s.lora_rank else 0),
        p_train,
        s,
        s.actor_micro_batch,
        s.actor_checkpointing,
        lm=True,
        accumulates=s.accumulates,
    )
    mb = s.logprob_micro_batch
    items.append(
        Item(
            "actor",
            "log-prob forward: logits + chunks",
            logits_bytes(
                actor, mb, s.response_len, 4 if s.autocast else ec, tp=s.tp, accelerator=s.accelerator, train=False
            ),
            "log-probs",
            note=f"micro-batch {mb}, no grad",
        )
    )
    e_lg = 4 if s.autocast else ec  # the logits' bytes, as the log-prob forward's
    frozen = [("reference", "kl_full", s.kl_full, s.kl_full_loss)]
    if teacher is not None and s.distill_estimator is not None:
        frozen.append(("teacher", s.distill_estimator, True, True))
    # the log-prob pass frees the reference's logits before the teacher's forward: the larger of the two
    nograd = [(r, est) for r, est, on, _ in frozen if on]
    if nograd:
        role, est = max(
            nograd,
            key=lambda x: full_logits_bytes(actor, mb, s.response_len, e_lg, x[1], tp=s.tp, accelerator=s.accelerator),
        )
        b = full_logits_bytes(actor, mb, s.response_len, e_lg, est, tp=s.tp, accelerator=s.accelerator)
        what = "kl_full" if est == "kl_full" else f"distill.estimator={est}"
        items.append(Item(role, f"{role} logits + {what} chunks", b, "log-probs", note=f"micro-batch {mb}, no grad"))
    for role, est, _, in_loss in frozen:
        if in_loss:  # both terms of the loss keep their frozen logits until the backward
            b = full_logits_bytes(
                actor, s.actor_micro_batch, s.response_len, e_lg, est, tp=s.tp, accelerator=s.accelerator, train=True
            )
            what = "KL loss (kl_full)" if est == "kl_full" else f"distill.estimator={est}"
            items.append(
                Item(
                    "actor",
                    f"{role} logits + their gradient, {what}",
                    b,
                    "actor backward",
                    note=f"micro-batch {s.actor_micro_batch}: kept for the backward, which builds the logits' gradient",
                )
            )
    if s.separate_ref:
        params["reference"] = ref.causal_lm_params()
        items.append(_frozen_role(s, "reference", params["reference"], s.storage_dtype, f"sharded over {n} devices"))
    if teacher is not None:  # distill.teacher: always its own frozen copy, as a separate reference
        params["teacher"] = teacher.causal_lm_params()
        note = f"sharded over {n} devices as the reference (distill.teacher)"
        items.append(_frozen_role(s, "teacher", params["teacher"], s.storage_dtype, note))
    if s.critic:
        params["critic"] = critic_shape.value_model_params()
        items += _trained_role(
            "critic",
            critic_shape,
            params["critic"],
            params["critic"],
            s,
            s.critic_micro_batch,
            s.critic_checkpointing,
            lm=False,
            accumulates=s.accumulates,
        )
    for role, shape in (("reward model", reward if s.reward_model else None), ("val reward model", val_reward)):
        if shape is None:
            continue
        params[role] = shape.reward_model_params()
        rd = shape.dtype if s.accelerator else "float32"
        note = f"sharded over {n} devices as the reference (dtype=auto on a GPU: the checkpoint's)"
        items.append(_frozen_role(s, role, params[role], rd, note))
    rows, problems = entry(s.engine).plan(s, actor)  # the rollout engine's own memory (tether.engines)
    items += [Item(r.role, r.what, r.bytes, r.phase, note=r.note) for r in rows]
    return Plan(s, items, params, problems=problems)


def _frozen_role(s: PlanSettings, role: str, n_params: int, dtype: str, note: str) -> Item:
    """The weights of a frozen role (reference, teacher, reward model): ``n_params`` in ``dtype``, sharded over the
    devices, no optimizer; on the host under ``trainer.fsdp.cpu_offload``."""
    b = n_params * DTYPE_BYTES[dtype] // s.devices
    offload = " [offloaded]" if s.offload else ""
    return Item(
        role, f"weights ({dtype}, no optimizer){offload}", 0 if s.offload else b, host=b if s.offload else 0, note=note
    )


def _changes(s: PlanSettings, a: ModelShape, max_tp: int) -> list[tuple[str, PlanSettings]]:
    """Single changes to try on ``s``, each as (label naming the key or flag, new settings)."""
    tries: list[tuple[str, PlanSettings]] = []
    t2 = s.tp * 2
    if t2 <= max_tp and s.devices % t2 == 0 and a.heads % t2 == 0 and a.kv_heads % t2 == 0:
        tries.append((f"tensor parallel {t2} (--tp-size {t2})", replace(s, tp=t2)))
    if not s.offload:
        tries.append(("CPU offload (--offload; trainer.fsdp.cpu_offload=true)", replace(s, offload=True)))
    if not (s.actor_checkpointing and (s.critic_checkpointing or not s.critic)):
        tries.append(
            (
                "activation checkpointing, actor and critic (--activation-checkpointing)",
                replace(s, actor_checkpointing=True, critic_checkpointing=True),
            )
        )
    micro = max(s.actor_micro_batch, s.critic_micro_batch if s.critic else 0)
    if micro > 1:
        m = micro // 2
        tries.append(
            (
                f"micro-batch {m} (actor.micro_batch_size={m} critic.micro_batch_size={m})",
                replace(
                    s,
                    actor_micro_batch=min(s.actor_micro_batch, m),
                    critic_micro_batch=min(s.critic_micro_batch, m),
                    logprob_micro_batch=min(s.logprob_micro_batch, m),
                    accumulates=True,
                ),
            )
        )
    if s.response_len > 1:
        r = s.response_len // 2
        tries.append((f"response length {r} (rollout.max_new_tokens={r})", replace(s, response_len=r)))
    if s.lora_rank == 0:
        tries.append(("LoRA rank 64 (actor.lora.rank=64 ref.model=null)", replace(s, lora_rank=64, separate_ref=False)))
    if (changes := entry(s.engine).plan_changes) is not None:  # the engine's own settings
        tries += [(label, replace(s, **fields)) for label, fields in changes(s, a, max_tp)]
    for name, other in ENGINES.items():  # another engine, where it would bring something
        if name != s.engine and other.plan_offer is not None and (label := other.plan_offer(s)):
            tries.append((f"{label} (rollout.engine={name})", replace(s, engine=name)))
    if s.compute_dtype == "float32":
        tries.append(
            ("bfloat16 compute, fp32 master weights (--param-dtype bfloat16)", replace(s, compute_dtype="bfloat16"))
        )
    return tries


def suggestions(
    settings: PlanSettings, shapes: dict, *, max_tp: int = 8
) -> tuple[list[tuple[str, int, int]], list[tuple[str, int, int]]]:
    """What each single change would bring the peak to, and a greedy combination that fits.

    Tried: tp × 2 (up to ``max_tp``, while it divides the heads, KV heads and devices), CPU offload,
    activation checkpointing, half the micro-batch, half the response length, LoRA rank 64 on a
    full-parameter actor, vLLM instead of HF generate, bfloat16 compute with fp32 master weights.

    Returns:
        ``(single, combined)``: [(label, score, peak bytes, problems)] for each change alone (score =
        peak, plus 2**62 when something else rules the run out, e.g. vLLM's reservation too small;
        problems = what rules it out, the changed plan's :attr:`Plan.problems`); and the changes taken
        one after another, each time the one that lowers the score most, until the plan fits (or
        nothing lowers it further), as (label, score, peak) after each.
    """

    def score(t: PlanSettings) -> tuple[int, int, tuple[str, ...]]:
        p = plan_memory(t, **shapes)
        return p.peak + (1 << 62 if p.problems else 0), p.peak, tuple(p.problems)

    single = [(label, *score(t)) for label, t in _changes(settings, shapes["actor"], max_tp)]
    combined: list[tuple[str, int, int]] = []
    cur, best = settings, score(settings)[0]
    for _ in range(8):
        if best <= cur.device_memory:
            break
        options = [(*score(t)[:2], label, t) for label, t in _changes(cur, shapes["actor"], max_tp)]
        if not options or min(options, key=lambda o: o[0])[0] >= best:
            break
        best, peak, label, cur = min(options, key=lambda o: o[0])
        combined.append((label, best, peak))
    return single, combined


def _gib(b: int) -> str:
    return f"{b / GIB:8.2f}"


def format_plan(plan: Plan) -> str:
    """The plan as a text table (GiB per device), the peak, a verdict and, when it does not fit, the suggestions."""
    s = plan.settings
    lines = [
        f"devices {s.devices} (dp {s.dp} × tp {s.tp}), {s.device_memory / GIB:.1f} GiB each; weights "
        f"{s.storage_dtype}, compute {s.compute_dtype}{', CPU offload' if s.offload else ''}; prompt {s.prompt_len} + "
        f"response {s.response_len} tokens",
        "parameters: "
        + ", ".join(f"{k} {v / 1e9:.3f} B" if v >= 1e8 else f"{k} {v:,}" for k, v in plan.params.items()),
        "",
        f"{'role':<22} {'what':<62} {'GiB/device':>10}  phase",
        "-" * 110,
    ]
    for i in plan.items:
        shown = _gib(i.bytes) if i.bytes or not i.host else "    host"
        lines.append(f"{i.role:<22} {i.what[:62]:<62} {shown:>10}  {i.phase}")
    phases = plan.phase_bytes()
    lines += ["-" * 110, f"{'kept through the step':<85} {_gib(plan.persistent):>10}"]
    for ph, b in sorted(phases.items(), key=lambda kv: -kv[1]):
        lines.append(f"{'phase ' + ph:<85} {_gib(b):>10}{'  <- largest' if ph == plan.peak_phase else ''}")
    lines.append(f"{'peak per device':<85} {_gib(plan.peak):>10}")
    if plan.host_per_node:
        lines.append(
            f"{'host memory per node (offloaded shards of ' + str(s.node_devices) + ' devices)':<85} "
            f"{_gib(plan.host_per_node):>10}"
        )
    lines.append("")
    for note in plan.notes:
        lines.append(f"note: {note}")
    for problem in plan.problems:
        lines.append(f"problem: {problem}")
    if plan.fits:
        lines.append(
            f"verdict: FITS: peak {plan.peak / GIB:.1f} GiB of {s.device_memory / GIB:.1f} GiB, headroom "
            f"{plan.headroom / GIB:.1f} GiB ({plan.headroom / s.device_memory:.0%})"
            + (
                f"; needs {plan.host_per_node / GIB:.0f} GiB of host RAM per node for the offloaded shards"
                if plan.host_per_node
                else ""
            )
        )
    else:
        over = f"over by {-plan.headroom / GIB:.1f} GiB" if plan.headroom < 0 else "see the problem above"
        lines.append(
            f"verdict: DOES NOT FIT: peak {plan.peak / GIB:.1f} GiB of {s.device_memory / GIB:.1f} GiB, {over}"
        )
        if plan.suggestions:
            lines.append("each change alone would give (peak per device):")
            for label, score, peak, problems in sorted(plan.suggestions, key=lambda x: x[1]):
                verdict = (
                    "fits"
                    if score <= s.device_memory
                    else ("still over" if score == peak else "ruled out: " + "; ".join(problems))
                )
                lines.append(f"  {label:<82} {_gib(peak)} GiB  {verdict}")
        if plan.combined:
            lines.append("together, the largest saving first (peak after each):")
            for label, _, peak in plan.combined:
                lines.append(f"  + {label:<80} {_gib(peak)} GiB")
            fits = plan.combined[-1][1] <= s.device_memory
            lines.append("  -> fits" if fits else "  -> still does not fit: more devices, or a smaller model")
    return "\n".join(lines)


def _named_shape(name: str) -> dict | None:
    """The :mod:`tether.plan_shapes` entry ``name`` stands for (any case), unless a path of that name exists."""
    if name == EMBEDDED or Path(name).expanduser().exists():
        return None
    return SHAPES.get(name.lower())


def resolve_shape(name: str | None, key: str) -> ModelShape | None:
    """The shape of a model key of ``tether plan`` (``actor.model``, ``ref.model``, ``critic.model``,
    ``reward.model``, ``reward.val_model``): a local model directory's ``config.json`` (``embedded`` included), else
    a named shape of :mod:`tether.plan_shapes` (``qwen2.5-7b``; a directory of the same name wins).
    None for None (the role defaults to the actor's model).

    Raises:
        ValueError: one line naming ``key``: neither a directory nor a named shape (with the closest
            names and the list of them), a directory without config.json, or a config.json field
            that is missing or not a positive integer / true or false (naming the file and field).
    """
    import difflib

    if name is None:
        return None
    named = _named_shape(name)
    if named is not None:
        return ModelShape.from_config(named, where=f"{key}={name!r} (named shape)")
    if name != EMBEDDED and not Path(name).expanduser().exists():
        wanted = name.lower().rstrip("/").rsplit("/", 1)[-1]  # "meta-llama/Llama-3.1-8B" -> "llama-3.1-8b"
        close = difflib.get_close_matches(wanted, list(SHAPES), n=3, cutoff=0.6)
        hint = f" (did you mean {' or '.join(close)}?)" if close else ""
        raise ValueError(
            f"{key}={name!r}: no such local model directory, nor a named shape{hint}; tether plan's named shapes: "
            f"{', '.join(SHAPES)}"
        )
    path = resolve_model_path(name, key)  # a file, or a directory without config.json: its ConfigError names the key
    try:
        return ModelShape.from_config(path)
    except ValueError as e:
        raise ValueError(f"{key}: {e}") from None


def plan_config(
    cfg,
    *,
    devices: int,
    device_memory: int,
    tp_size: int | None = None,
    offload: bool | None = None,
    param_dtype: str | None = None,
    gpus_per_node: int | None = None,
    activation_checkpointing: bool | None = None,
    rollout_tp: int | None = None,
) -> Plan:
    """The plan of a :class:`tether.config.TetherConfig`: reads ``config.json`` of ``actor.model``,
    ``ref.model``, ``critic.model``, ``reward.model``, ``reward.val_model`` and ``distill.teacher`` (local
    directories; no weights), or
    takes their named shapes (:func:`resolve_shape`).

    Raises:
        ValueError: a model that is neither a directory with a valid config.json nor a named shape,
            or bad devices / tp (names the key).
    """
    s = PlanSettings.from_config(
        cfg,
        devices=devices,
        device_memory=device_memory,
        tp_size=tp_size,
        offload=offload,
        param_dtype=param_dtype,
        gpus_per_node=gpus_per_node,
        activation_checkpointing=activation_checkpointing,
        rollout_tp=rollout_tp,
    )
    keys = {
        "actor": ("actor.model", cfg.actor.model),
        "ref": ("ref.model", cfg.ref.model),
        "critic": ("critic.model", cfg.critic.model),
        "reward": ("reward.model", cfg.reward.model),
        "val_reward": ("reward.val_model", cfg.reward.val_model),
        # distill.teacher=exact: a lookup table of the embedded task's π*_β, no weights
        "teacher": ("distill.teacher", None if cfg.distill.teacher == EXACT_TEACHER else cfg.distill.teacher),
    }
    shapes = {role: resolve_shape(name, key) for role, (key, name) in keys.items()}
    actor = shapes["actor"]
    for key, sh in (("actor.model", actor), ("critic.model", shapes["critic"])):
        if sh is not None and (sh.heads % s.tp or sh.kv_heads % s.tp):
            raise ValueError(
                f"tensor-parallel size {s.tp} must divide the attention heads ({sh.heads}) and KV heads "
                f"({sh.kv_heads}) of {key}"
            )
    plan = plan_memory(s, **shapes)
    if not plan.fits:
        plan.suggestions, plan.combined = suggestions(s, shapes)
    named = [f"{key}={name}" for key, name in keys.values() if name is not None and _named_shape(name) is not None]
    if named:
        plan.notes.append(f"named shapes (published config.json fields; tether plan only): {', '.join(named)}")
    default_len = type(cfg.rollout).model_fields["max_new_tokens"].default
    if cfg.actor.model != EMBEDDED and cfg.rollout.max_new_tokens == default_len:
        plan.notes.append(
            f"responses of rollout.max_new_tokens={default_len} tokens, the default sized for the embedded digit-sum "
            f"task: add rollout.max_new_tokens=N (and data.max_prompt_length=N, now {cfg.data.max_prompt_length}) "
            "with your task's lengths, e.g. rollout.max_new_tokens=1024"
        )
    if devices > 1 and getattr(cfg.trainer, "backend", "local") == "local":
        plan.notes.append(
            f"--devices {devices}: planned for the Ray backend's FSDP2 sharding (trainer.backend=ray); the local "
            "backend uses one device"
        )
    return plan


def main_plan(
    config: str | None,
    overrides: list[str],
    *,
    devices: int,
    device_memory: str,
    tp_size: int | None = None,
    offload: bool | None = None,
    param_dtype: str | None = None,
    gpus_per_node: int | None = None,
    activation_checkpointing: bool | None = None,
    rollout_tp: int | None = None,
) -> int:
    """``tether plan``: print the table and the verdict. Returns 0 when it fits, 1 when it does not,
    2 for a bad config, model directory or name, config.json field or flag (one line on stderr,
    ``tether plan: ...``, naming it)."""
    import sys

    try:
        cfg = load_config(config, overrides)
        plan = plan_config(
            cfg,
            devices=devices,
            device_memory=parse_size(device_memory),
            tp_size=tp_size,
            offload=offload,
            param_dtype=param_dtype,
            gpus_per_node=gpus_per_node,
            activation_checkpointing=activation_checkpointing,
            rollout_tp=rollout_tp,
        )
    except (ConfigError, ValueError) as e:
        print(f"tether plan: {e}", file=sys.stderr)
        return 2
    print(format_plan(plan))
    return 0 if plan.fits else 1
