"""Benchmark: throughput of ``tether eval`` (prompts and samples per second) against the batch size.

A tiny Qwen2-architecture model with a GSM8K-like tokenizer (built locally by ``tether.testing``,
nothing downloaded) answers P synthetic GSM8K-style prompts with n samples each, through the same
:class:`tether.evaluation.evaluate.Evaluator` as ``tether eval`` (reward: the GSM8K verifier; each response runs
to ``--max-new-tokens`` unless it samples EOS), one engine for all rows, started by an untimed
warm-up. One row per ``--batch-sizes`` value: wall seconds,
prompts/s, samples/s, generated tokens/s. With ``--engine vllm`` (a GPU with vLLM) the same sweep runs
through vLLM.

Usage:
    python benchmarks/bench_eval.py                                   # CPU: 64 prompts x 16, HF engine
    python benchmarks/bench_eval.py --prompts 500 --n 16 --device cuda --engine vllm --batch-sizes 16,64,500
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

from tether.data import write_records  # noqa: E402
from tether.evaluation.evaluate import EvalSettings, Evaluator  # noqa: E402
from tether.models import load_causal_lm, load_tokenizer  # noqa: E402
from tether.testing import build_gsm8k_tokenizer, build_tiny_causal_lm, synthetic_math_texts  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--batch-sizes", default="4,16,64")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--engine", default="hf", choices=["hf", "vllm"])
    a = ap.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        texts = synthetic_math_texts(max(a.prompts, 200))
        tok_dir = build_gsm8k_tokenizer(root / "tok", texts=texts)
        model_dir = build_tiny_causal_lm(root / "model", tok_dir, arch="qwen2", hidden=128, layers=2, heads=2, seed=0)
        rows = [
            {
                "data_source": "openai/gsm8k",
                "prompt": [{"role": "user", "content": t.split("####")[0][:300] + f" (#{i})"}],
                "reward_model": {"ground_truth": "7"},
            }
            for i, t in enumerate(texts[: a.prompts])
        ]
        data = root / "prompts.jsonl"
        write_records(rows, data)
        tok = load_tokenizer(model_dir)
        model = load_causal_lm(model_dir).to(a.device).eval()
        print(
            f"| batch size (prompts) | sequences / call | seconds | prompts/s | samples/s | tokens/s |   ({a.prompts} "
            f"prompts x n={a.n}, <= {a.max_new_tokens} tokens, {a.engine} on {a.device})"
        )
        print("|---|---|---|---|---|---|")
        ev = Evaluator(
            data,
            EvalSettings(n=a.n, max_new_tokens=a.max_new_tokens, device=a.device, engine=a.engine),
            tok,
            torch.device(a.device),
        )
        everything = ev.indices
        ev.indices = everything[:4]
        ev(model, model_path=model_dir)  # warm-up, untimed: builds the engine (vLLM's start-up and compilation)
        ev.indices = everything
        for bs in (int(x) for x in a.batch_sizes.split(",")):
            ev.settings.batch_size = bs  # one engine for every row
            samples: list[dict] = []
            t0 = time.perf_counter()
            m = ev(model, model_path=model_dir, samples=samples)
            dt = time.perf_counter() - t0
            toks = sum(r["length"] for r in samples)
            print(
                f"| {bs} | {bs * a.n} | {dt:.1f} | {m['prompts'] / dt:.1f} | {len(samples) / dt:.0f} | {toks / dt:.0f} "
                "|"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
