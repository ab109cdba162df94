"""Step throughput of tether against TRL's GRPOTrainer on the identical workload (issue 13).

    make bench-peer                                   # installs TRL 1.16 into .venv-trl, then runs this
    .venv-trl/bin/python benchmarks/bench_peer_trl.py [--steps 4] [--pairs 3] [--models tiny,small]
        [--tether-args actor.compute_dtype=bfloat16] [--trl-bf16] [--extra] [--skip-trl]

What it runs. Two Qwen2 models with random weights, built here from a config (nothing is
downloaded), with a byte-level BPE tokenizer of that vocabulary built here too:

* ``tiny``:  vocab 100, hidden 64, 2 layers, 4 heads (2 KV heads), MLP 128, tied embeddings: ~81k parameters;
* ``small``: vocab 2000, hidden 256, 8 layers, 4 heads (2 KV heads), MLP 512, tied: ~5.2M parameters.

The workload, identical for both libraries: GRPO, 8 prompts of 16 tokens × G = 8 samples, 32 new
tokens with EOS blocked (``suppress_tokens`` = the EOS ids, so every response is 32 tokens),
temperature 1, no top-p/top-k, reward = the fraction of response characters with an even code
point (a cheap Python function), group-std-normalised advantages, clipped surrogate ε = 0.2, β = 0.04 · k3 KL to
the frozen reference in the loss, token-mean aggregation, one optimizer step of all 64 responses
per generation batch (one mini-batch, one micro-batch, one epoch), AdamW lr 1e-5 constant,
grad clip 1.0, float32, one torch thread, CPU.

How: each (library, model) run is a fresh process (``--worker``), alternating tether, TRL,
tether, TRL, ... (``--pairs`` pairs per model), so that drift in the machine's load hits both
alike. A run trains ``--steps`` steps and reports each step's wall time, a phase breakdown, and the
reward and KL of each step. The first step of a run (lazy initialisation) is left out of the
medians. ``--extra`` adds tether-alone rows: the embedded default task (``tether train``'s
config) and a GSM8K-shaped workload on the small model (prompts of 120-180 tokens, EOS allowed
and made likely enough that responses end anywhere up to 256 tokens), so padding and prompt costs
show; each ``--variant`` runs these rows too, alternating, ``--extra-rounds`` times.

Phases: generate (sampling, decoding included), reward, no-grad log-prob passes (tether: the
actor's old log-probs and the reference; TRL: the reference), update forward, backward, optimizer
step, and other (the rest of the step). Backward and optimizer are timed by the same global hooks
in both libraries (``torch.Tensor.backward`` and torch's optimizer step hooks).

The machine: a 2-core CPU shared with other jobs, so numbers are noisy; the table gives each
ratio's range over the pairs. Run it when the box is quiet for numbers worth quoting.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]

MODELS = {
    # name: (vocab, hidden, layers, heads, kv heads, intermediate)
    "tiny": (100, 64, 2, 4, 2, 128),
    "small": (2000, 256, 8, 4, 2, 512),
}
SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # pad, (unused), eos: ids 0, 1, 2
N_PROMPTS, GROUP, NEW_TOKENS, PROMPT_TOKENS = 8, 8, 32, 16
GSM_NEW_TOKENS = 256


# ---------------------------------------------------------------- the shared reward (both libraries)
def _even_fraction(text: str) -> float:
    """The fraction of the response's characters with an even code point (0 for an empty response)."""
    return sum(ord(c) % 2 == 0 for c in text) / len(text) if text else 0.0


def tether_reward(data_sources, solution_strs, ground_truths, extra_infos):
    """tether's batch reward-function signature."""
    return [_even_fraction(s) for s in solution_strs]


def trl_reward(completions, **kwargs):
    """TRL's reward-function signature (standard, non-conversational prompts)."""
    return [_even_fraction(c) for c in completions]


# ---------------------------------------------------------------- assets: tokenizers, models, prompts
def build_tokenizer(out: Path, vocab: int) -> Path:
    """A byte-level BPE tokenizer of exactly ``vocab`` tokens, Qwen2-loadable.

    Ids 0-2 are the special tokens (pad, unused, EOS); then the 94 printable ASCII characters and the
    byte-level symbols of space, newline and tab (97 single-character tokens); then seeded random
    two-character merges up to ``vocab``. (Transformers loads a tokenizer saved in a Qwen2 model
    directory as ``Qwen2Tokenizer``, which rebuilds a byte-level BPE from the vocabulary and merges,
    so a word-level tokenizer would not survive; this one does.)
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(33, 127)] + ["Ġ", "Ċ", "ĉ"]
    base = list(SPECIAL) + chars
    if vocab < len(base):
        raise ValueError(f"vocab={vocab} must be at least {len(base)}")
    rng = random.Random(0)
    merges: list[tuple[str, str]] = []
    seen = set(base)
    while len(base) + len(merges) < vocab:
        a, b = rng.choice(chars[:94]), rng.choice(chars[:94])
        if a + b not in seen:
            seen.add(a + b)
            merges.append((a, b))
    ids = {t: i for i, t in enumerate(base)} | {a + b: len(base) + i for i, (a, b) in enumerate(merges)}
    tok = Tokenizer(models.BPE(vocab=ids, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=SPECIAL[2], pad_token=SPECIAL[0])
    out.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(out)
    return out


def build_model(out: Path, name: str, *, eos_logit_boost: float = 0.0) -> Path:
    """A random Qwen2ForCausalLM of ``MODELS[name]`` with its tokenizer, saved to ``out``.

    ``eos_logit_boost`` > 0 makes EOS likely (for the GSM8K-shaped workload): every token's
    embedding gets a constant first coordinate 1, which dominates the final-norm output there, and
    the (tied) EOS row gets 1 + boost, so EOS's logit exceeds the others' by about boost · sqrt(H).
    """
    import torch
    from transformers import AutoTokenizer, GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    if (out / "config.json").is_file():
        return out
    vocab, hidden, layers, heads, kv, inter = MODELS[name]
    tok_dir = build_tokenizer(out.parent / f"tok{vocab}", vocab)
    tok = AutoTokenizer.from_pretrained(tok_dir)
    cfg = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=None,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(cfg)
    if eos_logit_boost:
        with torch.no_grad():
            emb = model.get_input_embeddings().weight  # (V, H)
            emb[:, 0] = 1.0
            emb[tok.eos_token_id, 0] = 1.0 + eos_logit_boost
    model.generation_config = GenerationConfig(
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None
    )
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def build_prompts(out: Path, n: int, lengths: tuple[int, int], seed: int = 0) -> Path:
    """``n`` prompts of random printable characters (one token each, unless a merge applies), lengths
    uniform in ``lengths`` (inclusive), as verl-schema jsonl."""
    rng = random.Random(seed)
    with open(out, "w") as f:
        for i in range(n):
            text = "".join(chr(rng.randrange(33, 127)) for _ in range(rng.randint(*lengths)))
            f.write(
                json.dumps({"prompt": text, "data_source": "bench", "reward_model": {"ground_truth": ""}, "index": i})
                + "\n"
            )
    return out


def param_count(model_dir: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        return sum(_prod(f.get_slice(k).get_shape()) for k in f.keys())


def _prod(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


# ---------------------------------------------------------------- phase timing shared by both workers
class Phases:
    """Accumulates seconds per phase; backward and optimizer steps are timed by global hooks."""

    def __init__(self):
        import torch
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        self.t: dict[str, float] = {}
        orig_backward = torch.Tensor.backward

        def backward(tensor, *a, **k):
            t0 = time.perf_counter()
            try:
                return orig_backward(tensor, *a, **k)
            finally:
                self.add("backward", time.perf_counter() - t0)

        torch.Tensor.backward = backward
        self._opt_t0 = 0.0
        register_optimizer_step_pre_hook(lambda *a: setattr(self, "_opt_t0", time.perf_counter()))
        register_optimizer_step_post_hook(lambda *a: self.add("optimizer", time.perf_counter() - self._opt_t0))

    def add(self, k: str, s: float) -> None:
        self.t[k] = self.t.get(k, 0.0) + s

    def take(self) -> dict[str, float]:
        out, self.t = self.t, {}
        return out


def timed(phases: Phases, fn, name):
    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            phases.add(name if isinstance(name, str) else name(), time.perf_counter() - t0)

    return wrapper


# ---------------------------------------------------------------- workers (one fresh process each)
def bench_threads() -> int:
    """torch threads of each worker process (``--threads``, passed down as ``BENCH_THREADS``; default 1)."""
    return int(os.environ.get("BENCH_THREADS", "1"))


def tether_overrides(
    model_dir: Path, prompts: Path, steps: int, new_tokens: int, out: Path, *, lr: float = 1e-5, seed: int = 0
) -> list[str]:
    return [
        f"actor.model={model_dir}",
        f"actor.lr={lr}",
        f"trainer.seed={seed}",
        "actor.micro_batch_size=64",
        "actor.grad_clip=1.0",
        "actor.dtype=float32",
        f"data.train_files={prompts}",
        f"data.batch_size={N_PROMPTS}",
        "data.apply_chat_template=false",
        "data.max_prompt_length=512",
        f"rollout.n={GROUP}",
        f"rollout.max_new_tokens={new_tokens}",
        "rollout.temperature=1.0",
        "rollout.top_p=1.0",
        "rollout.top_k=0",
        f"reward.function={HERE}:tether_reward",
        "kl.placement=loss",
        "kl.estimator=k3",
        "kl.coef=0.04",
        "kl.controller=fixed",
        "algo.adv_estimator=grpo",
        f"algo.mini_batch_size={N_PROMPTS * GROUP}",
        "algo.ppo_epochs=1",
        "algo.loss_agg_mode=token-mean",
        "guard.target_kl=null",
        f"trainer.total_steps={steps + 1000}",
        "trainer.val_freq=0",
        "trainer.save_freq=0",
        "trainer.loggers=[jsonl]",
        "trainer.progress=false",
        "trainer.report=false",
        f"trainer.threads={bench_threads()}",
        "trainer.device=cpu",
        f"trainer.output_dir={out}",
        "trainer.resume=off",
    ]


def block_eos(trainer) -> None:
    """EOS blocked (``suppress_tokens``): every response is NEW_TOKENS long, as in the TRL run."""
    trainer.roles.engine.engine.kwargs["suppress_tokens"] = list(trainer.roles.engine.eos_token_ids)


def worker_tether(args) -> dict:
    import torch

    torch.set_num_threads(bench_threads())
    phases = Phases()
    from tether.config import load_config
    from tether.trainer import Trainer

    if args.workload == "embedded":
        overrides = [
            "trainer.val_freq=0",
            "trainer.save_freq=0",
            "trainer.loggers=[jsonl]",
            "trainer.progress=false",
            "trainer.report=false",
            f"trainer.threads={bench_threads()}",
            "trainer.device=cpu",
            f"trainer.output_dir={args.run_dir}",
            "trainer.resume=off",
            "trainer.total_steps=100000",
        ]
    else:
        new = GSM_NEW_TOKENS if args.workload == "gsm8k" else NEW_TOKENS
        overrides = tether_overrides(
            Path(args.model), Path(args.prompts), args.steps, new, Path(args.run_dir), lr=args.lr, seed=args.seed
        )
    cfg = load_config(None, overrides + list(args.tether_args))
    trainer = Trainer(cfg)
    if args.workload == "peer":
        block_eos(trainer)
    steps = []
    for _ in range(args.steps):
        phases.take()
        t0, c0 = time.perf_counter(), time.process_time()
        m = trainer.train_step()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        hooks = phases.take()
        bwd, opt = hooks.get("backward", 0.0), hooks.get("optimizer", 0.0)
        ph = {
            "generate": m.get("timing/rollout_s", 0.0),
            "reward": m.get("timing/reward_s", 0.0),
            "logprobs (no grad)": m.get("timing/logprobs_s", 0.0),
            "update forward": m.get("timing/update_actor_s", 0.0) - bwd - opt,
            "backward": bwd,
            "optimizer": opt,
        }
        ph["other"] = wall - sum(ph.values())
        steps.append(
            {
                "s": wall,
                "cpu_s": cpu,
                "tokens": m["response/length_mean"] * cfg.data.batch_size * cfg.rollout.n,
                "reward": m.get("reward/score_mean"),
                "kl": m.get("kl/ref_mean"),
                "approx_kl": m.get("policy/approx_kl"),
                "clipfrac": m.get("policy/clipfrac"),
                "phases": ph,
                "mfu": m.get("perf/mfu"),
            }
        )
    return {"lib": "tether", "steps": steps}


def trl_trainer(
    model: Path, prompts: Path, run_dir: Path, steps: int, *, lr: float = 1e-5, seed: int = 0, bf16: bool = False
):
    """TRL 1.16's ``GRPOTrainer`` on the peer workload (the module doc), ``steps`` optimizer steps."""
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    tok = AutoTokenizer.from_pretrained(model)
    tok.padding_side = "left"
    rows = [json.loads(x) for x in Path(prompts).read_text().splitlines()]
    ds = Dataset.from_dict({"prompt": [r["prompt"] for r in rows]})
    eos = [tok.eos_token_id]
    cfg = GRPOConfig(
        output_dir=str(run_dir),
        per_device_train_batch_size=N_PROMPTS * GROUP,
        num_generations=GROUP,
        steps_per_generation=1,
        gradient_accumulation_steps=1,
        num_iterations=1,
        max_completion_length=NEW_TOKENS,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        generation_kwargs={"suppress_tokens": eos},
        beta=0.04,
        epsilon=0.2,
        loss_type="dapo",
        scale_rewards="group",
        learning_rate=lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        max_steps=steps,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        bf16=bf16,
        fp16=False,
        seed=seed,
        dataloader_num_workers=0,
        disable_tqdm=True,
        log_completions=False,
        model_init_kwargs={"dtype": "float32"},
    )
    return GRPOTrainer(model=str(model), reward_funcs=trl_reward, args=cfg, train_dataset=ds, processing_class=tok)


def worker_trl(args) -> dict:
    import torch

    torch.set_num_threads(bench_threads())
    phases = Phases()
    from transformers import TrainerCallback

    trainer = trl_trainer(
        Path(args.model),
        Path(args.prompts),
        Path(args.run_dir),
        args.steps,
        lr=args.lr,
        seed=args.seed,
        bf16=args.trl_bf16,
    )
    trainer._generate = timed(phases, trainer._generate, "generate")
    trainer._calculate_rewards = timed(phases, trainer._calculate_rewards, "reward")
    trainer._get_per_token_logps_and_entropies = timed(
        phases,
        trainer._get_per_token_logps_and_entropies,
        lambda: "update forward" if torch.is_grad_enabled() else "logprobs (no grad)",
    )
    marks: list[float] = []
    cpu_marks: list[float] = []
    per_step: list[dict] = []

    class Clock(TrainerCallback):
        def on_train_begin(self, *a, **k):
            phases.take()
            marks.append(time.perf_counter())
            cpu_marks.append(time.process_time())

        def on_step_end(self, *a, **k):
            marks.append(time.perf_counter())
            cpu_marks.append(time.process_time())
            per_step.append(phases.take())

    trainer.add_callback(Clock())
    trainer.train()
    logs = [h for h in trainer.state.log_history if "reward" in h]
    steps = []
    for i, ph in enumerate(per_step):
        wall = marks[i + 1] - marks[i]
        ph = {
            k: ph.get(k, 0.0)
            for k in ("generate", "reward", "logprobs (no grad)", "update forward", "backward", "optimizer")
        }
        ph["other"] = wall - sum(ph.values())
        log = logs[i] if i < len(logs) else {}
        steps.append(
            {
                "s": wall,
                "cpu_s": cpu_marks[i + 1] - cpu_marks[i],
                "tokens": float(N_PROMPTS * GROUP * log.get("completions/mean_length", NEW_TOKENS)),
                "reward": log.get("reward"),
                "kl": log.get("kl"),
                "approx_kl": None,
                "clipfrac": log.get("clip_ratio/region_mean"),
                "phases": ph,
                "mfu": None,
            }
        )
    return {"lib": "trl", "steps": steps}


# ---------------------------------------------------------------- driver
def run_worker(
    lib: str,
    model: Path,
    prompts: Path,
    steps: int,
    workdir: Path,
    tag: str,
    extra: list[str],
    workload: str = "peer",
    trl_bf16: bool = False,
    src: Path = ROOT / "src",
    lr: float = 1e-5,
    seed: int = 0,
) -> dict:
    out = workdir / "runs" / f"{tag}-{time.strftime('%H%M%S')}-{random.randrange(10**6)}"
    res = out.with_suffix(".json")
    cmd = [
        sys.executable,
        str(HERE),
        "--worker",
        lib,
        "--model",
        str(model),
        "--prompts",
        str(prompts),
        "--steps",
        str(steps),
        "--run-dir",
        str(out),
        "--result",
        str(res),
        "--workload",
        workload,
        "--lr",
        repr(lr),
        "--seed",
        str(seed),
    ]
    if trl_bf16:
        cmd.append("--trl-bf16")
    for a in extra:
        cmd += ["--tether-arg", a]
    n = str(bench_threads())
    env = dict(
        os.environ,
        OMP_NUM_THREADS=n,
        MKL_NUM_THREADS=n,
        BENCH_THREADS=n,
        TOKENIZERS_PARALLELISM="false",
        PYTHONPATH=str(src),
    )
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if p.returncode:
        sys.stderr.write(p.stdout[-3000:] + p.stderr[-6000:])
        raise SystemExit(f"{lib} worker failed on {model.name} (exit {p.returncode})")
    r = json.loads(res.read_text())
    r["process_s"] = time.perf_counter() - t0
    return r


def peer_inputs(work: Path, name: str) -> tuple[Path, Path]:
    """The bench model ``name`` (``tiny``/``small``) and its prompt file, built under ``work`` (or reused)."""
    return build_model(work / f"qwen2-{name}", name), build_prompts(
        work / f"prompts-{name}.jsonl", N_PROMPTS, (PROMPT_TOKENS, PROMPT_TOKENS)
    )


def run_variant(
    args, work: Path, model: Path, prompts: Path, variant: tuple[str, Path, list[str]], tag: str, seed: int
) -> dict:
    """One fresh worker process of ``variant`` (label, tether source tree, overrides; label ``trl`` is TRL)
    on the peer workload, ``args.steps`` steps at ``args.lr``."""
    lab, src, extra = variant
    lib = "trl" if lab == "trl" else "tether"
    return run_worker(
        lib, model, prompts, args.steps, work, tag, extra, trl_bf16=args.trl_bf16, src=src, lr=args.lr, seed=seed
    )


def median_step(r: dict, key: str = "s") -> float:
    """Median seconds per step of a run, its first step left out: wall (``s``) or the process's CPU time (``cpu_s``)."""
    xs = [s[key] for s in r["steps"][1:]] or [s[key] for s in r["steps"]]
    return statistics.median(xs)


def median_phases(r: dict) -> dict[str, float]:
    rows = r["steps"][1:] or r["steps"]
    return {k: statistics.median(s["phases"][k] for s in rows) for k in rows[0]["phases"]}


def tokens_per_step(r: dict) -> float:
    rows = r["steps"][1:] or r["steps"]
    return statistics.median(s["tokens"] for s in rows)


def fmt_phases(ph: dict[str, float]) -> str:
    tot = sum(ph.values())
    return ", ".join(f"{k} {v:.3f} ({100 * v / tot:.0f}%)" for k, v in ph.items())


def report_pair(name: str, params: int, runs: dict[str, list[dict]]) -> list[str]:
    lines = [f"### {name} ({params / 1e3:.0f}k parameters)", ""]
    med = {lib: statistics.median(median_step(r) for r in rs) for lib, rs in runs.items()}
    cpu = {lib: statistics.median(median_step(r, "cpu_s") for r in rs) for lib, rs in runs.items()}
    lines.append(
        "| library | median s/step (wall) | median CPU s/step | CPU / wall (> 1: threads in parallel) | tokens/s "
        "(wall) | runs (wall s/step each) |"
    )
    lines.append("| --- | ---: | ---: | ---: | ---: | --- |")
    for lib, rs in runs.items():
        tps = statistics.median(tokens_per_step(r) / median_step(r) for r in rs)
        par = statistics.median(median_step(r, "cpu_s") / median_step(r) for r in rs)
        lines.append(
            f"| {lib} | {med[lib]:.3f} | {cpu[lib]:.3f} | {par:.2f} | {tps:.0f} | "
            f"{', '.join(f'{median_step(r):.3f}' for r in rs)} |"
        )
    lines.append("")

    def ratio_line(num: str, den: str, bold: bool) -> str:
        w = [median_step(b) / median_step(a) for a, b in zip(runs[den], runs[num], strict=False)]
        c = [median_step(b, "cpu_s") / median_step(a, "cpu_s") for a, b in zip(runs[den], runs[num], strict=False)]
        mark = "**" if bold else ""
        return (
            f"* {num} / {den} s/step: wall {mark}{med[num] / med[den]:.2f}{mark} (per round "
            f"{min(w):.2f}–{max(w):.2f}), CPU {mark}{cpu[num] / cpu[den]:.2f}{mark} (per round "
            f"{min(c):.2f}–{max(c):.2f})"
        )

    for lab in runs:
        if lab != "trl" and "trl" in runs:
            lines.append(ratio_line("trl", lab, True))
        if lab not in ("trl", "tether") and "tether" in runs:
            lines.append(ratio_line(lab, "tether", False))
    lines += ["", "Phases (median seconds per step of each run's median; first run):", ""]
    for lib, rs in runs.items():
        lines.append(f"* {lib}: {fmt_phases(median_phases(rs[0]))}")
    lines += ["", "Reward / KL (k3, nats per token) per step, first run of each:", ""]
    for lib, rs in runs.items():
        rw = " ".join(f"{s['reward']:.3f}" if s["reward"] is not None else "-" for s in rs[0]["steps"])
        kl = " ".join(f"{s['kl']:.2e}" if s["kl"] is not None else "-" for s in rs[0]["steps"])
        lines.append(f"* {lib}: reward [{rw}]; KL [{kl}]")
    mfu = [s["mfu"] for s in runs.get("tether", [{}])[0].get("steps", [])[1:] if s.get("mfu") is not None]
    if mfu:
        lines.append(
            "* tether perf/mfu (update FLOP/s over the measured matmul ceiling in the compute dtype): median "
            f"{statistics.median(mfu):.2f}"
        )
    return lines + [""]


# ---------------------------------------------------------------- learning curves (--curve)
def curve_mean_std(curves: list[list[float]]) -> list[tuple[float, float]]:
    """Per step: the mean and the sample standard deviation (n − 1 in the denominator; 0 for one
    seed) over the seeds' curves (one list of per-step values per seed, all of one length)."""
    out = []
    for xs in zip(*curves, strict=True):
        out.append((statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0))
    return out


def within_noise(
    a: list[list[float]], b: list[list[float]], k: float = 2.0, atol: float = 0.0
) -> list[tuple[float, float, bool]]:
    """Per step, whether two libraries' mean curves agree within their seeds' noise.

    ``a``, ``b``: per-seed curves (n_a and n_b lists of per-step values). A step passes when
    |mean_a − mean_b| ≤ max(k · SE, atol), with SE = sqrt(s_a²/n_a + s_b²/n_b) the standard error
    of the difference of the two means (s = the seeds' sample standard deviation; Welch's form,
    which does not assume equal spreads). With k = 2 a step of two identically distributed curves
    passes about 95% of the time (less with few seeds, whose s is itself noisy). ``atol`` is a floor
    for values that are round-off (a KL of 1e-15 nats against TRL's exact 0 at step 1 or at a
    learning rate of ~0). Returns (|diff|, the bound, ok) per step.
    """
    out = []
    for (ma, sa), (mb, sb) in zip(curve_mean_std(a), curve_mean_std(b), strict=True):
        bound = max(k * (sa * sa / len(a) + sb * sb / len(b)) ** 0.5, atol)
        diff = abs(ma - mb)
        out.append((diff, bound, diff <= bound))
    return out


KL_ATOL = 1e-6  # nats/token: KL differences below this are round-off, not learning (report_curve)


def curves_of(runs: list[dict], key: str) -> list[list[float]]:
    """Per run (seed), the per-step values of ``key`` (``reward`` or ``kl``; a missing value reads 0)."""
    return [[s[key] or 0.0 for s in r["steps"]] for r in runs]


def report_curve(
    name: str, runs: dict[str, list[dict]], lr: float, against: str = "trl", lags: dict[str, int] | None = None
) -> list[str]:
    """Markdown: per step, mean ± std over seeds of reward and KL for each variant, and which steps of
    each variant lie within noise of ``against``'s (and of ``tether``'s, for other tether variants).

    ``lags``: label -> steps of staleness (``rollout.async_steps``): such a variant's step t + lag is
    also compared with tether's step t, since its batch at step t + lag comes from the policy of
    t − 1 updates, like sync tether's batch at step t."""
    labs = list(runs)
    n = len(runs[labs[0]][0]["steps"])
    stats = {lab: {key: curve_mean_std(curves_of(rs, key)) for key in ("reward", "kl")} for lab, rs in runs.items()}
    seeds = {lab: len(rs) for lab, rs in runs.items()}
    lines = [
        f"### learning curves, {name} model, lr {lr:g} ({', '.join(f'{lab}: {k} seeds' for lab, k in seeds.items())})",
        "",
    ]
    head = " | ".join(f"{lab} reward" for lab in labs) + " | " + " | ".join(f"{lab} KL" for lab in labs)
    lines += [f"| step | {head} |", "| ---: |" + " ---: |" * (2 * len(labs))]
    for i in range(n):
        rw = " | ".join(f"{stats[lab]['reward'][i][0]:.3f} ± {stats[lab]['reward'][i][1]:.3f}" for lab in labs)
        kl = " | ".join(f"{stats[lab]['kl'][i][0]:.2e} ± {stats[lab]['kl'][i][1]:.1e}" for lab in labs)
        lines.append(f"| {i + 1} | {rw} | {kl} |")
    lines.append("")
    pairs = [(lab, against) for lab in labs if lab != against and against in runs]
    pairs += [(lab, "tether") for lab in labs if lab not in (against, "tether") and "tether" in runs]
    pairs = [(lab, ref, 0) for lab, ref in pairs]
    pairs += [(lab, "tether", lag) for lab, lag in (lags or {}).items() if lag and lab in runs and "tether" in runs]
    for lab, ref, lag in pairs:
        parts = []
        n = len(runs[lab][0]["steps"]) - lag
        for key in ("reward", "kl"):
            mine = [c[lag:] for c in curves_of(runs[lab], key)]
            theirs = [c[: len(c) - lag] for c in curves_of(runs[ref], key)]
            w = within_noise(mine, theirs, atol=KL_ATOL if key == "kl" else 0.0)
            bad = [i + 1 for i, (_, _, ok) in enumerate(w) if not ok]
            worst = max(
                range(n), key=lambda i: w[i][0] / w[i][1] if w[i][1] > 0 else (0.0 if w[i][0] == 0 else float("inf"))
            )
            parts.append(
                f"{key} {n - len(bad)}/{n} steps (outside: {bad or 'none'}; largest |Δ|/bound {_ratio(w[worst])} at "
                f"step {worst + 1})"
            )
        what = (
            f"{lab} against {ref}"
            if not lag
            else f"{lab} step t + {lag} against {ref} step t (its {lag} step(s) of staleness)"
        )
        lines.append(f"* {what}, |Δ mean| within 2 × SE of the difference (KL: or {KL_ATOL:g}): " + "; ".join(parts))
    clip = {
        lab: [s["clipfrac"] for r in rs for s in r["steps"][1:] if s.get("clipfrac") is not None]
        for lab, rs in runs.items()
    }
    if any(clip.values()):
        lines.append(
            "* policy/clipfrac, mean over steps 2.. and seeds: "
            + ", ".join(f"{lab} {statistics.fmean(c):.4f}" for lab, c in clip.items() if c)
        )
    final = {lab: stats[lab]["reward"][-1] for lab in labs}
    first = ", ".join(f"{lab} {stats[lab]['reward'][0][0]:.3f}" for lab in labs)
    lines.append(
        "* final-step reward: "
        + ", ".join(f"{lab} {m:.3f} ± {s:.3f}" for lab, (m, s) in final.items())
        + f" (step 1: {first})"
    )
    return lines + [""]


def _ratio(w: tuple[float, float, bool]) -> str:
    diff, bound, _ = w
    return f"{diff / bound:.2f}" if bound > 0 else ("0" if diff == 0 else "inf")


def plot_curves(path: Path, name: str, runs: dict[str, list[dict]], lr: float) -> bool:
    """Reward and KL per step, mean ± std band over seeds, one line per variant, as a PNG (False
    when matplotlib is missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, key, label in zip(
        axes, ("reward", "kl"), ("reward (fraction of even code points)", "KL to π_ref (k3, nats/token)"), strict=True
    ):
        for lab, rs in runs.items():
            ms = curve_mean_std(curves_of(rs, key))
            x = list(range(1, len(ms) + 1))
            m = [a for a, _ in ms]
            ax.plot(x, m, label=f"{lab} ({len(rs)} seeds)")
            ax.fill_between(x, [a - s for a, s in ms], [a + s for a, s in ms], alpha=0.2)
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(f"{name} model, GRPO, lr {lr:g}: mean ± std over seeds")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=4, help="steps per run (the first is left out of medians)")
    ap.add_argument("--pairs", type=int, default=3, help="alternating tether/TRL process pairs per model")
    ap.add_argument(
        "--models", default="tiny,small", help="comma-separated; empty (or --pairs 0) for the --extra rows only"
    )
    ap.add_argument("--workdir", default=str(ROOT / ".tmp" / "bench_peer"))
    ap.add_argument(
        "--tether-args",
        nargs="*",
        default=[],
        help="extra tether overrides of every tether variant (each --variant's own follow), e.g. "
        "actor.compute_dtype=bfloat16",
    )
    ap.add_argument("--trl-bf16", action="store_true", help="TRL with bf16=True (its default setting)")
    ap.add_argument("--skip-trl", action="store_true", help="tether runs only (no TRL needed)")
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="LABEL=SRC|ARGS",
        help="another tether variant in the rotation: a source tree (empty: this one) and overrides, e.g. "
        "'base=/tmp/old/src|' or 'bf16=|actor.compute_dtype=bfloat16'",
    )
    ap.add_argument("--extra", action="store_true", help="add tether-alone rows: embedded default, GSM8K-shaped")
    ap.add_argument("--extra-rounds", type=int, default=1, help="--extra: alternating rounds of the tether variants")
    ap.add_argument("--json", default=None, help="write all runs here")
    ap.add_argument(
        "--curve",
        action="store_true",
        help="learning curves instead of throughput: --seeds seeds per variant at --lr over --steps steps, "
        "alternating; prints mean ± std per step and which steps agree within noise, and plots them (--pairs and "
        "--extra do not apply). At the defaults nothing learns: the docs use --lr 3e-3 --steps 20 --seeds 5 (tiny) and "
        "--lr 1e-3 --steps 30 --seeds 3 (small)",
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads per worker process, both libraries (default 1); a variant may set trainer.threads itself",
    )
    ap.add_argument("--lr", type=float, default=1e-5, help="learning rate of both libraries (AdamW, constant)")
    ap.add_argument("--seeds", type=int, default=3, help="--curve: seeds per variant (0, 1, ...)")
    ap.add_argument("--seed", type=int, default=0, help="the seed of a throughput run (both libraries)")
    ap.add_argument("--plot-dir", default=None, help="--curve: PNGs go here (default: the workdir)")
    # worker mode (internal)
    hidden = argparse.SUPPRESS  # one worker process's options, set by run_worker
    ap.add_argument("--worker", choices=["tether", "trl"], help=hidden)
    for opt in ("--model", "--prompts", "--run-dir", "--result"):
        ap.add_argument(opt, help=hidden)
    ap.add_argument("--workload", default="peer", choices=["peer", "embedded", "gsm8k"], help=hidden)
    ap.add_argument("--tether-arg", action="append", default=[], dest="tether_args_w", help=hidden)
    args = ap.parse_args()
    if not args.worker:  # workers read theirs from the environment run_worker gives them
        os.environ["BENCH_THREADS"] = str(args.threads)

    if args.worker:
        args.tether_args = args.tether_args_w
        r = (worker_tether if args.worker == "tether" else worker_trl)(args)
        Path(args.result).write_text(json.dumps(r))
        return

    work = Path(args.workdir)
    (work / "runs").mkdir(parents=True, exist_ok=True)
    # each variant: (label, tether source tree, extra overrides); "trl" is TRL
    variants = [("tether", ROOT / "src", list(args.tether_args))]
    for v in args.variant:
        label, _, rest = v.partition("=")
        src, _, extra = rest.partition("|")
        variants.append((label, Path(src or ROOT / "src"), list(args.tether_args) + extra.split()))
    if not args.skip_trl:
        variants.append(("trl", ROOT / "src", []))
    if args.curve:
        return main_curve(args, work, variants)
    load = os.getloadavg()[0]
    print(
        f"# tether vs TRL, {args.steps} steps per run, {args.pairs} rounds, load average {load:.1f} on "
        f"{os.cpu_count()} CPUs, {args.threads} torch thread(s) per process"
    )
    print(
        f"# variants: {[(lab, str(src), ex) for lab, src, ex in variants]}; TRL {'bf16' if args.trl_bf16 else 'fp32'}\n"
    )
    out_lines, everything = [], {}
    for name in [m for m in args.models.split(",") if m and args.pairs > 0]:
        model, prompts = peer_inputs(work, name)
        runs: dict[str, list[dict]] = {lab: [] for lab, _, _ in variants}
        for _ in range(args.pairs):
            for variant in variants:
                lab = variant[0]
                r = run_variant(args, work, model, prompts, variant, f"{lab}-{name}", args.seed)
                runs[lab].append(r)
                print(
                    f"  {lab:10s} {name:5s} median {median_step(r):.3f} s/step (process {r['process_s']:.0f} s)",
                    flush=True,
                )
        everything[name] = runs
        out_lines += report_pair(name, param_count(model), runs)
    if args.extra:
        gsm_model = build_model(work / "qwen2-small-gsm", "small", eos_logit_boost=0.8)
        gsm_prompts = build_prompts(work / "prompts-gsm.jsonl", N_PROMPTS, (120, 180))
        rows = [
            ("embedded default (16 prompts × 8, 4 tokens)", None, None, "embedded", max(args.steps, 10)),
            (
                "GSM8K-shaped, small model (8 × 8, prompts 120-180, responses ≤ 256)",
                gsm_model,
                gsm_prompts,
                "gsm8k",
                args.steps,
            ),
        ]
        out_lines += [
            "### tether alone",
            "",
            "| workload | variant | median s/step (wall) | median CPU s/step | response tokens/step | tokens/s (wall) "
            "| phases (wall s) |",
            "| --- | --- | ---: | ---: | ---: | ---: | --- |",
        ]
        # each --variant too, alternating, --extra-rounds rounds
        tether_variants = [v for v in variants if v[0] != "trl"]
        for label, m, p, wl, n in rows:
            everything[wl] = {lab: [] for lab, _, _ in tether_variants}
            for _ in range(args.extra_rounds):
                for lab, src, extra in tether_variants:
                    r = run_worker(
                        "tether",
                        m or Path("embedded"),
                        p or Path("-"),
                        n,
                        work,
                        f"{lab}-{wl}",
                        extra,
                        workload=wl,
                        src=src,
                    )
                    everything[wl][lab].append(r)
                    print(
                        f"  {lab} {wl} median {median_step(r):.3f} s/step, CPU {median_step(r, 'cpu_s'):.3f}",
                        flush=True,
                    )
            for lab, runs in everything[wl].items():
                s = statistics.median(median_step(r) for r in runs)
                cpu = statistics.median(median_step(r, "cpu_s") for r in runs)
                tok = tokens_per_step(runs[0])
                out_lines.append(
                    f"| {label} | {lab} | {s:.3f} | {cpu:.3f} | {tok:.0f} | {tok / s:.0f} | "
                    f"{fmt_phases(median_phases(runs[0]))} |"
                )
        out_lines.append("")
    print("\n" + "\n".join(out_lines))
    if args.json:
        Path(args.json).write_text(json.dumps(everything, indent=1))


def main_curve(args, work: Path, variants: list[tuple[str, Path, list[str]]]) -> None:
    """--curve: per model, seeds 0..--seeds-1, each seed running every variant in turn (fresh processes)."""
    print(
        f"# learning curves: {args.steps} steps, lr {args.lr:g}, seeds 0..{args.seeds - 1}, load average "
        f"{os.getloadavg()[0]:.1f}"
    )
    print(
        f"# variants: {[(lab, str(src), ex) for lab, src, ex in variants]}; TRL {'bf16' if args.trl_bf16 else 'fp32'}\n"
    )
    out_lines, everything = [], {}
    for name in [m for m in args.models.split(",") if m]:
        model, prompts = peer_inputs(work, name)
        runs: dict[str, list[dict]] = {lab: [] for lab, _, _ in variants}
        for seed in range(args.seeds):
            for variant in variants:
                lab = variant[0]
                r = run_variant(args, work, model, prompts, variant, f"curve-{lab}-{name}-s{seed}", seed)
                runs[lab].append(r)
                rw = [s["reward"] or 0.0 for s in r["steps"]]
                print(
                    f"  {lab:10s} {name:5s} seed {seed}: reward {rw[0]:.3f} -> {rw[-1]:.3f}, KL "
                    f"{r['steps'][-1]['kl'] or 0:.3g}, median {median_step(r):.3f} s/step, CPU "
                    f"{median_step(r, 'cpu_s'):.3f} (process {r['process_s']:.0f} s)",
                    flush=True,
                )
        everything[name] = runs
        lags = {lab: 1 for lab, _, extra in variants if "rollout.async_steps=1" in extra}
        out_lines += report_curve(name, runs, args.lr, lags=lags)
        png = Path(args.plot_dir or work) / f"curve-{name}-lr{args.lr:g}.png"
        if plot_curves(png, name, runs, args.lr):
            out_lines += [f"(plot: {png})", ""]
    print("\n" + "\n".join(out_lines))
    if args.json:
        Path(args.json).write_text(json.dumps(everything, indent=1))


if __name__ == "__main__":
    main()
