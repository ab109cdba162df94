"""tether's HF decode loop against ``model.generate``, in one process, alternating (issue 13, item 5).

    PYTHONPATH=src python benchmarks/bench_hf_decode.py [--models tiny,small] [--workloads peer,gsm8k]
        [--rounds 10] [--variants generate,tether,drop,icdf]

Each round runs every variant once on the same model, prompts and seed, in turn, one torch thread;
the table gives per variant the median process CPU seconds per rollout batch (``time.process_time``)
and the median over rounds of its ratio to ``generate`` in the same round (alternating in one process
cancels most of a shared box's load drift), and whether its tokens equal ``generate``'s (bitwise, all
rounds). Variants: ``generate`` (``rollout.hf_decode=generate``), ``tether`` (the default:
``rollout.hf_decode=tether``), ``drop`` (+ ``rollout.hf_drop_finished=true``), ``icdf``
(+ ``rollout.hf_sampler=inverse_cdf``: other samples by design, so "tokens equal" is no).

Models and workloads are ``bench_generate.py``'s (random-weight Qwen2 models built locally; ``peer``:
8 prompts × G = 8 of 16 tokens, 32 new tokens, EOS blocked; ``gsm8k``: prompts of 120–180 tokens, up to
256 new tokens with EOS made likely, ragged lengths; the small model only). The first round is a
warm-up and left out.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE.parent))

from bench_generate import WORKLOADS, _prompts, build_model, build_prompts  # noqa: E402

VARIANTS = {  # name: HFRolloutEngine keywords
    "generate": dict(hf_decode="generate"),
    "tether": dict(hf_decode="tether"),
    "drop": dict(hf_decode="tether", drop_finished=True),
    "icdf": dict(hf_decode="tether", sampler="inverse_cdf"),
}


def run(name: str, workload: str, variants: list[str], rounds: int, work: Path) -> list[str]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tether.rollout import HFRolloutEngine, SamplingParams, response_mask_from_ids

    lengths, new_tokens, eos_allowed, boost = WORKLOADS[workload]
    model_dir = build_model(work / f"qwen2-{name}{'-eos' if boost else ''}", name, eos_logit_boost=boost)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompt_ids, prompt_mask = _prompts(tok, build_prompts(work / f"prompts-{workload}.jsonl", 8, lengths))
    overrides = {} if eos_allowed else {"suppress_tokens": [tok.eos_token_id]}
    cpu: dict[str, list[float]] = {v: [] for v in variants}
    same = dict.fromkeys(variants, True)
    tokens = 0
    for r in range(rounds + 1):
        ref = None
        for v in variants:
            engine = HFRolloutEngine(model, tok, **VARIANTS[v])
            torch.manual_seed(r)
            c0 = time.process_time()
            ids, _ = engine.generate_padded(
                prompt_ids, prompt_mask, SamplingParams(max_new_tokens=new_tokens), **overrides
            )
            c = time.process_time() - c0
            ref = ids if ref is None else ref
            same[v] &= torch.equal(ids, ref)
            if r:  # round 0 warms up
                cpu[v].append(c)
            if v == variants[0]:
                tokens = int(response_mask_from_ids(ids, [tok.eos_token_id]).sum()) if eos_allowed else ids.numel()
        print(
            f"  {name} {workload} round {r}: " + ", ".join(f"{v} {cpu[v][-1]:.3f}" for v in variants if r), flush=True
        )
    base = variants[0]
    lines = []
    for v in variants:
        ratio = statistics.median(x / b for x, b in zip(cpu[v], cpu[base], strict=True))
        lines.append(
            f"| {name} | {workload} | {v} | {statistics.median(cpu[v]):.4f} | {ratio:.3f} | "
            f"{'yes' if same[v] else 'no'} | {tokens} |"
        )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="tiny,small", help="for the peer workload")
    ap.add_argument("--gsm8k-models", default="small")
    ap.add_argument("--workloads", default="peer,gsm8k")
    ap.add_argument("--variants", default="generate,tether,drop,icdf", help="the first is the ratios' base")
    ap.add_argument("--rounds", type=int, default=10, help="timed rounds (after one warm-up round)")
    ap.add_argument("--workdir", default=str(ROOT / ".tmp" / "bench_generate"))
    args = ap.parse_args()
    import os

    import torch

    torch.set_num_threads(1)
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    variants = args.variants.split(",")
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        raise SystemExit(f"unknown variant(s) {sorted(unknown)}; valid: {', '.join(VARIANTS)}")
    print(f"# HF decode: {args.rounds} rounds, load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs\n")
    lines = [
        f"| model | workload | variant | median CPU s/batch | CPU / {variants[0]} (median of rounds) | tokens equal "
        f"{variants[0]}'s | response tokens ({variants[0]}, last round) |",
        "| --- | --- | --- | ---: | ---: | --- | ---: |",
    ]
    for wl in args.workloads.split(","):
        for name in (args.gsm8k_models if wl == "gsm8k" else args.models).split(","):
            lines += run(name, wl, variants, args.rounds, work)
    print("\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
