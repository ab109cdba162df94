"""The tiny reference policy of the digit-sum task: tokenizer, demonstrations and supervised fine-tuning.

:func:`build_reference` trains a 2-layer ``transformers`` Llama on demonstrations that are diverse
and only partly correct, and writes a ``save_pretrained`` directory (safetensors weights, config,
generation config, tokenizer) that loads through ``AutoModelForCausalLM.from_pretrained`` and
``AutoTokenizer.from_pretrained``, the same path as a real model. A built copy ships in
``src/tether/tasks/assets/digitsum_ref/`` (:func:`default_reference_path`); rebuild it with
``python -m tether.tasks.sft src/tether/tasks/assets/digitsum_ref``.

Demonstrations (:func:`make_demonstrations`): for each prompt, with probability ``p_correct`` an
answer drawn uniformly among the valid ones, otherwise a wrong but well-formed digit string (k digits
with the wrong sum, or with probability ``p_short`` only k-1 digits). The model therefore starts
diverse, correct about half the time, with room for RL to improve and to collapse.
"""

from __future__ import annotations

import math
import random
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch

from tether.tasks import digitsum, digitsum_tool, exact
from tether.tasks.digitsum import BOS_TOKEN, CHARS, EOS_TOKEN, PAD_TOKEN

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
#: Size of the vocabulary: 3 special tokens + 10 digits + ',' + '='.
VOCAB_SIZE = 3 + len(CHARS)

#: Architecture of the reference (a ``LlamaConfig``; vocabulary and special ids are added).
MODEL_CONFIG = dict(
    hidden_size=64,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=32,
    tie_word_embeddings=True,
    rms_norm_eps=1e-6,
    initializer_range=0.02,
)
DEFAULT_STEPS = 1500
DEFAULT_BATCH_SIZE = 256
DEFAULT_LR = 3e-3
DEFAULT_P_CORRECT = 0.5
DEFAULT_P_SHORT = 0.15
DEFAULT_DEMOS_PER_PROMPT = 500

_ASSET_DIR = Path(__file__).resolve().parent / "assets" / "digitsum_ref"


def build_tokenizer():
    """A character-level ``PreTrainedTokenizerFast`` for the task, built locally with ``tokenizers``.

    Vocabulary (15 ids): ``<pad>``=0, ``<s>``=1 (BOS), ``</s>``=2 (EOS), ``'0'..'9'``=3..12,
    ``','``=13, ``'='``=14. Whitespace is removed before tokenization; every other character is one
    token, and a character outside the vocabulary raises (there is no UNK token, to keep the
    vocabulary, and so the exact enumeration, small). Encoding adds BOS in front; padding is on the
    left (for generation); decoding concatenates characters, so
    ``decode(ids, skip_special_tokens=True)`` of a response is the plain digit string.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {PAD_TOKEN: PAD_ID, BOS_TOKEN: BOS_ID, EOS_TOKEN: EOS_ID}
    for i, c in enumerate(CHARS):
        vocab[c] = 3 + i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=None))
    tok.normalizer = normalizers.Replace(Regex(r"\s"), "")
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A $B", special_tokens=[(BOS_TOKEN, BOS_ID)]
    )
    tok.add_special_tokens([PAD_TOKEN, BOS_TOKEN, EOS_TOKEN])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        padding_side="left",
        truncation_side="left",
        clean_up_tokenization_spaces=False,
        model_max_length=MODEL_CONFIG["max_position_embeddings"],
    )


def make_demonstrations(
    prompts: Sequence[tuple[int, int]],
    per_prompt: int = DEFAULT_DEMOS_PER_PROMPT,
    *,
    p_correct: float = DEFAULT_P_CORRECT,
    p_short: float = DEFAULT_P_SHORT,
    seed: int = 0,
) -> list[tuple[str, str]]:
    """Demonstrations ``(prompt_text, answer_text)``, ``per_prompt`` for each ``(k, s)``.

    Each answer is, with probability ``p_correct``, uniform among the valid answers; otherwise wrong
    but well-formed: with probability ``p_short`` a uniform string of k-1 digits (a wrong length),
    else a uniform string of k digits whose sum is not ``s``. Deterministic for a given ``seed``.
    Raises ValueError for probabilities outside [0, 1] or ``per_prompt < 1``.
    """
    for name, p in (("p_correct", p_correct), ("p_short", p_short)):
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {p!r}")
    if per_prompt < 1:
        raise ValueError(f"per_prompt must be >= 1, got {per_prompt!r}")
    rng = random.Random(seed)
    demos = []
    for k, s in prompts:
        valid = digitsum.valid_answers(k, s)
        prompt = digitsum.make_prompt(k, s)
        for _ in range(per_prompt):
            if rng.random() < p_correct:
                answer = rng.choice(valid)
            elif k > 1 and rng.random() < p_short:
                answer = "".join(rng.choice("0123456789") for _ in range(k - 1))
            else:
                while True:
                    answer = "".join(rng.choice("0123456789") for _ in range(k))
                    if sum(map(int, answer)) != s:
                        break
            demos.append((prompt, answer))
    return demos


def _encode_demos(tokenizer, demos: Sequence[tuple[str, str]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ``input_ids`` (N, L) and ``labels`` (N, L) with -100 outside the response."""
    rows, labels = [], []
    for prompt, answer in demos:
        p = tokenizer(prompt)["input_ids"]
        a = tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rows.append(p + a)
        labels.append([-100] * len(p) + a)
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    lab = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, (r, lb) in enumerate(zip(rows, labels, strict=True)):
        ids[i, : len(r)] = torch.tensor(r)
        lab[i, : len(lb)] = torch.tensor(lb)
    return ids, lab


def new_model(seed: int = 0, model_config: dict | None = None):
    """A freshly initialised reference architecture (``LlamaForCausalLM``), seeded.

    ``model_config``: ``LlamaConfig`` entries that replace :data:`MODEL_CONFIG`'s (e.g.
    ``{"num_attention_heads": 2, "num_key_value_heads": 2}`` for head size 32, which vLLM's CPU
    kernels need)."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        **(MODEL_CONFIG | (model_config or {})),
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        do_sample=True,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        max_new_tokens=digitsum.MAX_NEW_TOKENS,
    )
    return model


def build_reference(
    out_dir: str | Path,
    *,
    seed: int = 0,
    steps: int = DEFAULT_STEPS,
    batch_size: int = DEFAULT_BATCH_SIZE,
    lr: float = DEFAULT_LR,
    p_correct: float = DEFAULT_P_CORRECT,
    p_short: float = DEFAULT_P_SHORT,
    demos_per_prompt: int = DEFAULT_DEMOS_PER_PROMPT,
    log_every: int = 0,
    model_config: dict | None = None,
) -> Path:
    """Train the tiny reference policy by SFT and save it to ``out_dir``.

    The demonstrations cover every prompt of ``make_dataset("all")`` (k = 3, s = 4..23). Training is
    AdamW with a cosine decay of ``lr`` to zero over ``steps`` mini-batches of ``batch_size``
    sequences drawn with replacement; the loss is the mean cross-entropy (nats) over response tokens
    (digits and EOS). Runs single-threaded (the thread count is restored afterwards), so a given seed
    gives bit-identical weights on a given CPU and torch build; the default build takes well under
    two minutes on one core.

    Args:
        out_dir: directory to write (created; existing files of the same name are overwritten).
        seed: seeds the initialisation, the demonstrations and the batch order.
        steps, batch_size, lr: optimisation settings (must be positive).
        p_correct, p_short, demos_per_prompt: see :func:`make_demonstrations`.
        log_every: print the loss every so many steps to stderr (0: silent).
        model_config: architecture changes, as in :func:`new_model`.

    Returns:
        ``Path(out_dir)``, holding ``model.safetensors``, ``config.json``, ``generation_config.json``,
        ``tokenizer.json`` and ``tokenizer_config.json``.

    Raises:
        ValueError: for a non-positive ``steps``, ``batch_size`` or ``lr``.
    """
    for name, v in (("steps", steps), ("batch_size", batch_size), ("lr", lr)):
        if not v > 0:
            raise ValueError(f"{name} must be positive, got {v!r}")
    out = Path(out_dir)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tokenizer = build_tokenizer()
        prompts = [(r["extra_info"]["k"], r["extra_info"]["s"]) for r in digitsum.make_dataset("all")]
        demos = make_demonstrations(prompts, demos_per_prompt, p_correct=p_correct, p_short=p_short, seed=seed)
        ids, labels = _encode_demos(tokenizer, demos)
        model = new_model(seed, model_config)
        return _train_and_save(
            out,
            model,
            tokenizer,
            ids,
            labels,
            steps=steps,
            batch_size=batch_size,
            lr=lr,
            seed=seed,
            log_every=log_every,
        )
    finally:
        torch.set_num_threads(threads)


def _train_and_save(
    out: Path, model, tokenizer, ids, labels, *, steps: int, batch_size: int, lr: float, seed: int, log_every: int
) -> Path:
    """:func:`train_sft` on the encoded demonstrations, then ``model`` (in eval mode) and ``tokenizer`` saved to
    ``out`` with a portable tokenizer config: the common tail of both references' builds."""
    train_sft(
        model,
        ids,
        labels,
        pad_id=tokenizer.pad_token_id,
        steps=steps,
        batch_size=batch_size,
        lr=lr,
        seed=seed,
        log_every=log_every,
    )
    model.eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    _portable_tokenizer_config(out)
    return out


def train_sft(
    model, ids, labels, *, pad_id: int, steps: int, batch_size: int, lr: float, seed: int, log_every: int = 0
):
    """The reference's SFT loop, in place: AdamW (betas 0.9, 0.98, no weight decay), cosine decay of ``lr`` to zero
    over ``steps`` mini-batches of ``batch_size`` rows of ``ids`` (N, L) drawn with replacement (seeded), gradient
    norm clipped at 1; the loss is the mean cross-entropy (nats) over the positions whose ``labels`` are not -100.
    Shared by the digit-sum reference and the tool task's (:mod:`tether.tasks.digitsum_tool`)."""
    attn = (ids != pad_id).long()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 0.5 * (1 + math.cos(math.pi * t / steps)))
    gen = torch.Generator().manual_seed(seed)
    t0 = time.perf_counter()
    for step in range(steps):
        idx = torch.randint(0, ids.shape[0], (batch_size,), generator=gen)
        logits = model(input_ids=ids[idx], attention_mask=attn[idx]).logits
        lab = labels[idx]
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), lab[:, 1:].reshape(-1), ignore_index=-100
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if log_every and (step % log_every == 0 or step == steps - 1):
            print(f"sft step {step:5d}  loss {loss.item():.4f}  {time.perf_counter() - t0:.1f}s", file=sys.stderr)


def _portable_tokenizer_config(out: Path) -> None:
    """Name the generic fast-tokenizer class, which every transformers release since 4.x can load."""
    import json

    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def default_reference_path() -> Path:
    """The shipped reference, ``src/tether/tasks/assets/digitsum_ref/`` inside the package."""
    return _ASSET_DIR


def ensure_reference(path: str | Path | None = None) -> Path:
    """Return a reference model directory, building it (default settings, seed 0) if missing.

    ``path=None`` means :func:`default_reference_path`. A directory counts as present when it holds
    ``config.json``, ``model.safetensors`` and ``tokenizer.json``.
    """
    p = Path(path) if path is not None else default_reference_path()
    if not all((p / f).is_file() for f in ("config.json", "model.safetensors", "tokenizer.json")):
        build_reference(p)
    return p


def load_reference(path: str | Path | None = None):
    """Load ``(model, tokenizer)`` from a reference directory (default: the shipped one, built if
    missing) through ``AutoModelForCausalLM`` / ``AutoTokenizer``; the model is in eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = ensure_reference(path)
    model = AutoModelForCausalLM.from_pretrained(p)
    model.eval()
    return model, AutoTokenizer.from_pretrained(p)


def reference_success_rate(
    model_or_path=None,
    prompts: Sequence[Mapping | str] | None = None,
    temperature: float = 1.0,
    tokenizer=None,
) -> float:
    """Exact mean over prompts of P(correct) when sampling the model at ``temperature``.

    ``model_or_path``: a model (then ``tokenizer`` is required), a model directory, or ``None`` for
    the shipped reference. ``prompts``: default every prompt of ``make_dataset("all")`` (k = 3,
    s = 4..23). Computed by enumeration, not sampling.
    """
    if model_or_path is None or isinstance(model_or_path, (str, bytes)) or hasattr(model_or_path, "__fspath__"):
        model, tokenizer = load_reference(model_or_path)
    else:
        if tokenizer is None:
            raise ValueError("tokenizer is required when model_or_path is a model")
        model = model_or_path
    rows = prompts if prompts is not None else digitsum.make_dataset("all")
    rates = []
    for item in rows:
        text, gt, extra, T = exact._prompt_spec(item, None, digitsum.compute_score)
        space = exact.enumerate_policy(model, tokenizer, text, T, temperature)
        rates.append(exact.expected_reward(space.logprobs, space.rewards(digitsum.compute_score, gt, extra)))
    return float(np.mean(rates))


def main_sft(out_dir: str | None = None, seed: int = 0, steps: int | None = None) -> int:
    """Entry point for ``tether sft``: build the reference into ``out_dir`` (default: the shipped
    asset directory), print where it went and its exact success rate; returns the exit code 0."""
    out = Path(out_dir) if out_dir is not None else default_reference_path()
    t0 = time.perf_counter()
    build_reference(out, seed=seed, steps=steps if steps is not None else DEFAULT_STEPS, log_every=250)
    dt = time.perf_counter() - t0
    rate = reference_success_rate(out)
    print(f"reference written to {out} in {dt:.1f}s; exact success rate at temperature 1: {rate:.4f}")
    return 0


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="Build the tiny digit-sum reference policy by SFT.")
    ap.add_argument("out_dir", nargs="?", default=None, help="output directory (default: the shipped asset)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=None)
    args = ap.parse_args()
    raise SystemExit(main_sft(args.out_dir, args.seed, args.steps))


# ---------------------------------------------------------------- the multi-turn task's reference (digitsum_tool)
def build_tool_tokenizer():
    """The digit-sum tokenizer (:func:`build_tokenizer`) with :data:`tether.tasks.digitsum_tool.CHAT_TEMPLATE`."""
    tok = build_tokenizer()
    tok.chat_template = digitsum_tool.CHAT_TEMPLATE
    return tok


def _encode_turns(tokenizer, demos):
    import torch

    rows, labels = [], []
    for segs in demos:
        ids, lab = [tokenizer.bos_token_id], [-100]
        for text, model_turn in segs:
            t = tokenizer(text, add_special_tokens=False)["input_ids"]
            if model_turn:
                t = t + [tokenizer.eos_token_id]
            ids += t
            lab += t if model_turn else [-100] * len(t)
        rows.append(ids)
        labels.append(lab)
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    lab = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, (r, b) in enumerate(zip(rows, labels, strict=True)):
        ids[i, : len(r)], lab[i, : len(b)] = torch.tensor(r), torch.tensor(b)
    return ids, lab


def build_tool_reference(
    out_dir: str | Path,
    *,
    seed: int = 0,
    steps: int = digitsum_tool.DEFAULT_STEPS,
    log_every: int = 0,
    model_config: dict | None = None,
) -> Path:
    """Train the digitsum_tool task's reference by SFT on :func:`tether.tasks.digitsum_tool.make_demonstrations`
    with the digit-sum reference's recipe (architecture, optimiser, batch size, learning rate: :func:`train_sft`),
    single-threaded so a seed gives the same weights on a given CPU and torch build; save it (weights, config, tokenizer
    with its chat template) to ``out_dir``. The loss covers model-turn tokens only (observation and prompt tokens are
    labelled -100). ``model_config``: architecture changes, as in :func:`new_model`. Rebuild the shipped copy with
    ``python scripts/build_tool_reference.py``."""
    import torch

    out = Path(out_dir)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tokenizer = build_tool_tokenizer()
        ids, labels = _encode_turns(tokenizer, digitsum_tool.make_demonstrations(seed=seed))
        model = new_model(seed, model_config)
        model.generation_config.max_new_tokens = digitsum_tool.MAX_NEW_TOKENS
        return _train_and_save(
            out,
            model,
            tokenizer,
            ids,
            labels,
            steps=steps,
            batch_size=DEFAULT_BATCH_SIZE,
            lr=DEFAULT_LR,
            seed=seed,
            log_every=log_every,
        )
    finally:
        torch.set_num_threads(threads)
