"""Tiny real-architecture models and tokenizers for tests. Nothing here downloads anything.

Everything is built locally in a second or two on a CPU:

* :func:`build_gsm8k_tokenizer` trains a byte-level BPE tokenizer with ``tokenizers`` on GSM8K text
  (or on ``texts`` you pass, or on a small built-in synthetic corpus when neither is available) and
  saves it so that ``transformers.AutoTokenizer.from_pretrained(dir)`` loads it, with a Qwen2-style
  chat template (``<|im_start|>role\\n...<|im_end|>\\n``), ``<|im_end|>`` as EOS and ``<|endoftext|>``
  as PAD, as in the Qwen2/Qwen2.5 instruct tokenizers.
* :func:`build_tiny_causal_lm` saves a randomly initialised ``Qwen2ForCausalLM`` or
  ``LlamaForCausalLM`` (safetensors, with the tokenizer and a ``generation_config.json``).
* :func:`build_tiny_digitsum_lm` trains, in seconds, a digit-sum policy like the embedded
  reference but with attention head size 32 (vLLM's CPU kernels refuse the reference's 16).
* :func:`build_tiny_reward_model` saves a randomly initialised ``*ForSequenceClassification`` with a
  single-logit head (``num_labels=1``) and ``pad_token_id`` set, the shape of a scalar reward model.

:func:`find_gsm8k_dir` locates the shared GSM8K data (``../shared/data/gsm8k`` relative to the
project root, or ``$TETHER_GSM8K_DIR``) so tests can skip cleanly when it is absent.

The models are random: they are for exercising code paths (loading, chat templates, generation,
log-probs, reward-model scoring), not for anything that needs a trained model.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

from tether.tasks.sft import build_reference, build_tool_reference

__all__ = [
    "QWEN2_CHAT_TEMPLATE",
    "SPECIAL_TOKENS",
    "build_gsm8k_tokenizer",
    "build_tiny_causal_lm",
    "build_tiny_digitsum_lm",
    "build_tiny_digitsum_tool_lm",
    "build_tiny_reward_model",
    "find_gsm8k_dir",
    "synthetic_math_texts",
]

#: Special tokens of the test tokenizer, in id order (ids 0, 1, 2), as in Qwen2.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

#: A Qwen2-style chat template (ChatML without Qwen's default system prompt).
QWEN2_CHAT_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + "
    "'\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_ENV_GSM8K = "TETHER_GSM8K_DIR"


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for the rendezvous of a test's process group (gloo)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def find_gsm8k_dir(start: str | Path | None = None) -> Path | None:
    """Locate the shared GSM8K data directory, or return None when it is not there.

    Order: ``$TETHER_GSM8K_DIR`` when set (the only place looked at then: set it to a missing path
    to simulate a machine without the data); otherwise, walking up from ``start`` (a file
    or directory; default: this module's location), the first ancestor ``A`` for which
    ``A/../shared/data/gsm8k`` or ``A/shared/data/gsm8k`` is a directory holding ``train.jsonl``.
    For a test file ``/work/main/tests/data/test_x.py`` this finds ``/work/shared/data/gsm8k``.

    Args:
        start: where to start walking up from.

    Returns:
        The directory, or None.
    """
    env = os.environ.get(_ENV_GSM8K)
    if env:
        return Path(env) if (Path(env) / "train.jsonl").is_file() else None
    here = Path(start) if start is not None else Path(__file__)
    here = here.resolve()
    for anc in [here, *here.parents]:
        for cand in (anc.parent / "shared" / "data" / "gsm8k", anc / "shared" / "data" / "gsm8k"):
            if (cand / "train.jsonl").is_file():
                return cand
    return None


def synthetic_math_texts(n: int = 400) -> list[str]:
    """A small deterministic corpus of GSM8K-like word problems (words, numbers, ``<<a+b=c>>``
    calculator annotations, ``#### N`` lines), used when no real text is available. It is varied
    enough to train the default 512-token vocabulary. ``n``: number of texts."""
    names = [
        "Ann",
        "Ben",
        "Cara",
        "Dev",
        "Eli",
        "Fay",
        "Gus",
        "Hana",
        "Ivan",
        "Jade",
        "Kofi",
        "Lena",
        "Mateo",
        "Nora",
        "Omar",
        "Priya",
    ]
    things = [
        "apples",
        "eggs",
        "books",
        "coins",
        "marbles",
        "cookies",
        "pencils",
        "tickets",
        "stamps",
        "flowers",
        "shirts",
        "candles",
        "puzzles",
        "oranges",
        "bottles",
        "blocks",
    ]
    places = ["store", "market", "school", "library", "bakery", "garden", "museum", "station"]
    days = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
    out = []
    for i in range(n):
        a, b, c = 3 + (7 * i) % 97, 2 + (11 * i) % 53, 2 + (5 * i) % 9
        name, other = names[i % len(names)], names[(i * 5 + 3) % len(names)]
        thing, place, day = things[(i // 3) % len(things)], places[i % len(places)], days[i % len(days)]
        kind = i % 3
        if kind == 0:
            text = (
                f"{name} has {a} {thing} and buys {b} more at the {place} on {day}. How many {thing} does {name} have "
                f"now?\n{name} has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} {thing}.\n#### {a + b}"
            )
        elif kind == 1:
            text = (
                f"Each of the {c} boxes at the {place} holds {a} {thing}. {other} takes {b} of them. How many {thing} "
                f"are left?\nThere are {c} * {a} = <<{c}*{a}={c * a}>>{c * a} {thing} in total.\nSo {c * a} - {b} = "
                f"<<{c * a}-{b}={c * a - b}>>{c * a - b} are left.\n#### {c * a - b}"
            )
        else:
            text = (
                f"{name} earns ${a} per hour and works {c} hours every {day}. {name} spends ${b} on lunch. How much "
                f"money does {name} save?\n{name} earns {a} * {c} = $<<{a}*{c}={a * c}>>{a * c}.\n{name} saves {a * c} "
                f"- {b} = $<<{a * c}-{b}={a * c - b}>>{a * c - b}.\n#### {a * c - b}"
            )
        out.append(text)
    return out


def _gsm8k_texts(n_rows: int) -> list[str] | None:
    d = find_gsm8k_dir()
    if d is None:
        return None
    texts: list[str] = []
    with open(d / "train.jsonl", encoding="utf-8") as f:
        for line in f:
            if len(texts) >= n_rows:
                break
            rec = json.loads(line)
            texts.append(rec["question"] + "\n" + rec["answer"])
    return texts


def build_gsm8k_tokenizer(
    out_dir: str | Path,
    *,
    vocab_size: int = 512,
    chat_template: bool = True,
    texts: Iterable[str] | None = None,
    n_rows: int = 300,
) -> Path:
    """Train a small byte-level BPE tokenizer and save it as a Hugging Face tokenizer.

    Args:
        out_dir: directory to write (created). Holds ``tokenizer.json`` and
            ``tokenizer_config.json`` (with ``chat_template`` when asked).
        vocab_size: total vocabulary including the 256 byte symbols and the 3 special tokens (an
            upper bound: too little text cannot teach that many merges; the defaults reach it).
        chat_template: set the Qwen2-style :data:`QWEN2_CHAT_TEMPLATE`; with False the tokenizer has
            no chat template (like a base model's).
        texts: training text. Default: question + answer of the first ``n_rows`` rows of GSM8K's
            ``train.jsonl`` (found by :func:`find_gsm8k_dir`), or :func:`synthetic_math_texts` when
            the shared data is absent.
        n_rows: how many GSM8K rows to read when ``texts`` is None.

    Returns:
        ``Path(out_dir)``. Special tokens: ``<|endoftext|>`` (id 0, PAD), ``<|im_start|>`` (id 1),
        ``<|im_end|>`` (id 2, EOS). No BOS token, as in Qwen2.

    Raises:
        ValueError: ``vocab_size`` too small to hold the byte alphabet and the special tokens.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size={vocab_size} must be at least {256 + len(SPECIAL_TOKENS)}")
    if texts is None:
        texts = _gsm8k_texts(n_rows) or synthetic_math_texts()
    texts = list(texts)

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    if chat_template:
        hf.chat_template = QWEN2_CHAT_TEMPLATE
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(out)
    return out


def _config_for(
    arch: str,
    *,
    vocab_size: int,
    hidden: int,
    layers: int,
    heads: int,
    pad_id: int,
    eos_id: int,
    num_labels: int | None = None,
):
    from transformers import LlamaConfig, Qwen2Config

    if hidden % heads:
        raise ValueError(f"hidden={hidden} must be divisible by heads={heads}")
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=2048,
        pad_token_id=pad_id,
        eos_token_id=eos_id,
        bos_token_id=None,
        tie_word_embeddings=True,
    )
    if num_labels is not None:
        common["num_labels"] = num_labels
    if arch == "qwen2":
        return Qwen2Config(**common)
    if arch == "llama":
        return LlamaConfig(**common)
    raise ValueError(f"arch must be 'qwen2' or 'llama', got {arch!r}")


def _load_tok(tokenizer_dir: str | Path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    if tok.pad_token_id is None or tok.eos_token_id is None:
        raise ValueError(f"tokenizer in {tokenizer_dir} needs a pad and an eos token")
    return tok


def build_tiny_causal_lm(
    out_dir: str | Path,
    tokenizer_dir: str | Path,
    *,
    arch: str = "qwen2",
    hidden: int = 32,
    layers: int = 2,
    heads: int = 2,
    seed: int = 0,
) -> Path:
    """Save a randomly initialised causal LM of a real architecture, with its tokenizer.

    Args:
        out_dir: directory to write (created): ``config.json``, ``generation_config.json``,
            ``model.safetensors`` and the tokenizer files.
        tokenizer_dir: a tokenizer directory (e.g. from :func:`build_gsm8k_tokenizer`); the
            vocabulary size is ``len(tokenizer)``.
        arch: ``"qwen2"`` (``Qwen2ForCausalLM``) or ``"llama"`` (``LlamaForCausalLM``).
        hidden: hidden size; ``intermediate_size = 2 * hidden``.
        layers: number of decoder layers.
        heads: attention heads (no grouped-query attention: KV heads = heads).
        seed: ``torch.manual_seed`` for the initialisation, so the same seed gives the same weights.

    Returns:
        ``Path(out_dir)``, loadable by ``AutoModelForCausalLM.from_pretrained``. Config and
        generation config carry the tokenizer's ``pad_token_id`` and ``eos_token_id``; embeddings
        are tied.

    Raises:
        ValueError: unknown ``arch``, ``hidden`` not divisible by ``heads``, or a tokenizer without
            pad/eos tokens.
    """
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    tok = _load_tok(tokenizer_dir)
    config = _config_for(
        arch,
        vocab_size=len(tok),
        hidden=hidden,
        layers=layers,
        heads=heads,
        pad_id=tok.pad_token_id,
        eos_id=tok.eos_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def build_tiny_reward_model(
    out_dir: str | Path,
    tokenizer_dir: str | Path,
    arch: str = "qwen2",
    seed: int = 0,
    *,
    hidden: int = 32,
    layers: int = 2,
    heads: int = 2,
) -> Path:
    """Save a randomly initialised scalar reward model (``*ForSequenceClassification``, one logit).

    Args:
        out_dir: directory to write (created), with the tokenizer files.
        tokenizer_dir: a tokenizer directory (e.g. from :func:`build_gsm8k_tokenizer`).
        arch: ``"qwen2"`` or ``"llama"``.
        seed: ``torch.manual_seed`` for the initialisation.
        hidden, layers, heads: sizes, as in :func:`build_tiny_causal_lm`.

    Returns:
        ``Path(out_dir)``, loadable by ``AutoModelForSequenceClassification.from_pretrained``, with
        ``num_labels=1`` and ``pad_token_id`` set (needed to find each sequence's last token).

    Raises:
        ValueError: as :func:`build_tiny_causal_lm`.
    """
    import torch
    from transformers import AutoModelForSequenceClassification

    tok = _load_tok(tokenizer_dir)
    config = _config_for(
        arch,
        vocab_size=len(tok),
        hidden=hidden,
        layers=layers,
        heads=heads,
        pad_id=tok.pad_token_id,
        eos_id=tok.eos_token_id,
        num_labels=1,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def build_tiny_digitsum_lm(
    out_dir: str | Path, *, heads: int = 2, steps: int = 200, batch_size: int = 64, seed: int = 0
) -> Path:
    """A digit-sum task policy with the embedded reference's tokenizer and shape except its heads.

    The architecture of :data:`tether.tasks.sft.MODEL_CONFIG` (hidden size 64, 2 layers) with
    ``heads`` attention heads (head size 64 / heads: 32 by default, which vLLM's CPU backend
    accepts), trained by the reference's SFT (:func:`tether.tasks.sft.build_reference`) for
    ``steps`` mini-batches of ``batch_size`` (the defaults take about 10 s on one core and give a
    model that answers with three digits and EOS, rarely correctly).

    Returns:
        ``Path(out_dir)``, a ``save_pretrained`` directory usable as ``actor.model`` with the
        embedded data (``data.train_files=embedded``).
    """
    return build_reference(
        out_dir,
        seed=seed,
        steps=steps,
        batch_size=batch_size,
        model_config={"num_attention_heads": heads, "num_key_value_heads": heads},
    )


def build_tiny_digitsum_tool_lm(out_dir: str | Path, *, heads: int = 2, steps: int = 300, seed: int = 0) -> Path:
    """A policy of the multi-turn task (``data.embedded_task=digitsum_tool``) with ``heads`` attention heads (head size
    64 / heads: 32 by default, which vLLM's CPU backend accepts; the shipped tool reference has 4 of 16): the tool
    reference's tokenizer (chat template included) and SFT (:func:`tether.tasks.sft.build_tool_reference`), for
    ``steps`` mini-batches. Returns ``Path(out_dir)``, usable as ``actor.model`` with that task."""
    return build_tool_reference(
        out_dir, seed=seed, steps=steps, model_config={"num_attention_heads": heads, "num_key_value_heads": heads}
    )
