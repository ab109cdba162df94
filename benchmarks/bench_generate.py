"""Rollout generation speed: Hugging Face ``generate`` against the vLLM engine (issue 13, item 5).

    PYTHONPATH=src .venv-vllm/bin/python benchmarks/bench_generate.py [--rounds 3] [--batches 3]
        [--models tiny,tiny-hd32,small] [--workloads peer,gsm8k] [--engines hf,vllm] [--hf-variants ...]

Both engines are tether's own (``HFRolloutEngine``, ``VLLMRolloutEngine``), driven as the trainer
drives them: one rollout batch is ``generate`` on 8 prompts × G = 8 left-padded rows, and for vLLM
also the weight push that follows every actor update (``sync_weights``: the HF model's weights
copied into vLLM and its prefix cache dropped), timed apart and included in the batch time.
vLLM returns its sampled-token log-probs (as the trainer asks it to); HF returns none.

Models (random weights from a config, the tokenizer built here, nothing downloaded; the same as
``bench_peer_trl.py``):

* ``tiny``: vocab 100, hidden 64, 2 layers, 4 heads of 16 (2 KV heads), MLP 128 (81k parameters).
  vLLM's CPU attention kernels need a head size of 32 or more: vLLM cannot run it (``n/a``).
* ``tiny-hd32``: the same sizes with 2 heads of 32 (1 KV head): the same parameter count, and vLLM runs it.
* ``small``: vocab 2000, hidden 256, 8 layers, 4 heads of 64 (2 KV heads), MLP 512 (5.2M).

Workloads:

* ``peer``: ``bench_peer_trl.py``'s: prompts of 16 tokens, 32 new tokens, EOS blocked (HF:
  ``suppress_tokens``; vLLM: ``ignore_eos``), so every row is 32 tokens.
* ``gsm8k``: GSM8K-shaped: prompts of 120-180 tokens, up to 256 new tokens with EOS allowed and made
  likely (``build_model(eos_logit_boost=0.8)``, mean response ~110 tokens), so a batch has ragged
  lengths: HF keeps stepping every row until the longest ends, vLLM schedules each row alone.

Fairness: every (engine, model, workload) run is a fresh process, the engines alternating
(hf, vllm, hf, vllm, ...), each with one compute thread (``torch.set_num_threads(1)``,
``OMP_NUM_THREADS=1``, vLLM's ``VLLM_CPU_OMP_THREADS_BIND=nobind``: no pinning), float32,
temperature 1, no top-p/top-k. A run does one warm-up batch (left out) and ``--batches`` timed
ones; the table gives medians over all timed batches of all rounds: wall and process CPU seconds
(``time.process_time``, all threads of the process) per batch, response tokens per batch (counted
by ``response_mask``), and tokens per wall second. The vLLM engine's start-up (model load, KV cache,
warm-up) is printed apart: it is paid once per run, not per step.

``--hf-variants`` compares ways of running the HF engine in the same rotation: ``base`` (the
engine as shipped: ``rollout.hf_decode=tether``, ``torch.inference_mode``, one prefill per distinct
prompt, ``rollout.share_prefill``), ``generate`` (the same with ``rollout.hf_decode=generate``: HF
``model.generate`` and its ``DynamicCache``), ``prealloc`` (HF ``model.generate`` given tether's
``PreallocatedCache`` filled by the shared prefill: the cache alone, without tether's loop), ``plain`` (the
engine before issue 13: ``generate``, ``torch.no_grad``, one prefill per row), ``drop`` (tether's loop
with ``rollout.hf_drop_finished``: rows that ended stop being stepped), ``icdf`` (tether's loop with
``rollout.hf_sampler=inverse_cdf``: other samples, so another token count on ragged workloads), ``noshare`` (one
prefill per row), ``nograd`` (``torch.no_grad``), ``static`` (``generate`` with
``cache_implementation="static"``).

Models per workload: ``--models`` for ``peer``; ``--gsm8k-models`` (default ``small``) for
``gsm8k``, whose EOS boost is tuned for the small model (on the tiny ones it ends every response
within a few tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE.parent))

from bench_peer_trl import MODELS, build_model, build_prompts  # noqa: E402

MODELS.setdefault("tiny-hd32", (100, 64, 2, 2, 1, 128))
N_PROMPTS, GROUP = 8, 8
WORKLOADS = {  # name: (prompt lengths, max new tokens, EOS allowed, eos_logit_boost)
    "peer": ((16, 16), 32, False, 0.0),
    "gsm8k": ((120, 180), 256, True, 0.8),
}


# ---------------------------------------------------------------- worker: one engine, one process
def _prompts(tok, path: Path, device="cpu"):
    import torch

    from tether.data.loading import collate_prompts

    texts = [json.loads(line)["prompt"] for line in path.read_text().splitlines()]
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    rep = [i for i in ids for _ in range(GROUP)]
    prompt_ids, prompt_mask = collate_prompts(rep, tok.pad_token_id, torch.device(device))
    return prompt_ids, prompt_mask


def worker(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    from tether.rollout import response_mask_from_ids

    _, new_tokens, eos_allowed, _ = WORKLOADS[args.workload]
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32)
    prompt_ids, prompt_mask = _prompts(tok, Path(args.prompts))
    sampling = dict(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=new_tokens)
    from tether.rollout import GenerationRequest, SamplingParams
    from tether.rollout.engine import pad_results

    t0 = time.perf_counter()
    overrides: dict = {}
    if args.engine == "vllm":
        import functools

        from vllm import SamplingParams

        from tether.rollout.vllm import VLLMRolloutEngine

        engine = VLLMRolloutEngine(args.model, tok, dtype="float32", seed=0, kv_cache_gib=1.0)
        if not eos_allowed:
            engine.sampling_params_cls = functools.partial(SamplingParams, ignore_eos=True)
    else:
        from tether.rollout import HFRolloutEngine

        engine = HFRolloutEngine(model, tok)
        if not eos_allowed:
            overrides["suppress_tokens"] = [tok.eos_token_id]
        if args.variant in ("generate", "plain", "static", "prealloc"):
            engine.hf_decode = "generate"
        if args.variant == "drop":
            engine.drop_finished = True
        if args.variant == "icdf":
            engine.sampler = "inverse_cdf"
        if args.variant in ("nograd", "plain"):
            engine.grad_mode = "no_grad"
        if args.variant in ("noshare", "plain"):
            engine.share_prefill = False
        if args.variant == "static":
            overrides["cache_implementation"] = "static"
        if args.variant == "prealloc":  # generate, its shared prefill written into a fresh PreallocatedCache per batch
            from tether.rollout.hf_decode import preallocated_cache

            P, shared = prompt_ids.shape[1], engine._shared_prefill
            engine._shared_prefill = lambda ids, mask: shared(ids, mask, preallocated_cache(model, P + new_tokens))
    startup = time.perf_counter() - t0
    torch.manual_seed(0)
    batches = []
    for b in range(args.batches + 1):
        w0, c0 = time.perf_counter(), time.process_time()
        sync_s = 0.0
        if args.engine == "vllm":
            engine.sync_weights(model)
            sync_s = time.perf_counter() - w0
            params = SamplingParams(**sampling, logprobs=True)
            requests = [
                GenerationRequest(i[m.bool()].tolist(), params) for i, m in zip(prompt_ids, prompt_mask, strict=True)
            ]
            ids, _ = pad_results(engine.generate(requests), tok.pad_token_id)
        else:
            ids, _ = engine.generate_padded(prompt_ids, prompt_mask, SamplingParams(**sampling), **overrides)
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
        ntok = int(response_mask_from_ids(ids, [tok.eos_token_id]).sum()) if eos_allowed else ids.numel()
        if b:  # the first batch warms up
            batches.append({"wall_s": wall, "cpu_s": cpu, "sync_s": sync_s, "tokens": ntok, "width": ids.shape[1]})
    return {"startup_s": startup, "batches": batches}


def run_worker(engine: str, variant: str, model: Path, prompts: Path, workload: str, batches: int, work: Path) -> dict:
    result = work / f"result-{engine}-{variant}-{model.name}-{workload}.json"
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        VLLM_CPU_OMP_THREADS_BIND="nobind",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        TOKENIZERS_PARALLELISM="false",
    )
    tmp = Path(env.get("TMPDIR") or ROOT / ".tmp")
    for key, sub in (
        ("VLLM_CACHE_ROOT", "vllm/cache"),
        ("VLLM_CONFIG_ROOT", "vllm/config"),
        ("TORCHINDUCTOR_CACHE_DIR", "vllm/inductor"),
    ):
        env.setdefault(key, str(tmp / sub))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    cmd = [
        sys.executable,
        str(HERE),
        "--worker",
        engine,
        "--variant",
        variant,
        "--model",
        str(model),
        "--prompts",
        str(prompts),
        "--workload",
        workload,
        "--batches",
        str(batches),
        "--result",
        str(result),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode:
        return {"error": (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["?"]}
    return json.loads(result.read_text())


# ---------------------------------------------------------------- driver
def _med(runs: list[dict], key: str) -> float:
    return statistics.median(b[key] for r in runs for b in r["batches"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds (one fresh process per engine per round)")
    ap.add_argument(
        "--batches", type=int, default=3, help="timed rollout batches per process (after one warm-up batch)"
    )
    ap.add_argument("--models", default="tiny,tiny-hd32,small")
    ap.add_argument("--workloads", default="peer,gsm8k")
    ap.add_argument("--gsm8k-models", default="small")
    ap.add_argument("--engines", default="hf,vllm")
    ap.add_argument(
        "--hf-variants",
        default="base,generate",
        help="comma-separated: base, generate, prealloc, drop, icdf, plain, noshare, nograd, static",
    )
    ap.add_argument("--workdir", default=str(ROOT / ".tmp" / "bench_generate"))
    ap.add_argument("--json", default=None, help="write all runs here")
    ap.add_argument("--worker", choices=["hf", "vllm"])
    ap.add_argument("--variant", default="base")
    ap.add_argument("--model"), ap.add_argument("--prompts"), ap.add_argument("--result")
    ap.add_argument("--workload", default="peer", choices=sorted(WORKLOADS))
    args = ap.parse_args()
    if args.worker:
        args.engine = args.worker
        Path(args.result).write_text(json.dumps(worker(args)))
        return

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    kinds = [("hf", v) for v in args.hf_variants.split(",") if "hf" in args.engines.split(",")]
    kinds += [("vllm", "base")] if "vllm" in args.engines.split(",") else []
    print(
        f"# generation: {args.rounds} rounds × {args.batches} batches, load average {os.getloadavg()[0]:.1f} on "
        f"{os.cpu_count()} CPUs\n"
    )
    lines = [
        "| model | workload | engine | wall s/batch | CPU s/batch | weight push s | tokens/batch | tokens/s (wall) | "
        "tokens/CPU-s | start-up s |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    everything: dict = {}
    for wl in args.workloads.split(","):
        lengths, _, _, boost = WORKLOADS[wl]
        prompts = build_prompts(work / f"prompts-{wl}.jsonl", N_PROMPTS, lengths)
        for name in (args.gsm8k_models if wl == "gsm8k" else args.models).split(","):
            model = build_model(work / f"qwen2-{name}{'-eos' if boost else ''}", name, eos_logit_boost=boost)
            runs: dict[str, list[dict]] = {f"{e}:{v}": [] for e, v in kinds}
            for _ in range(args.rounds):
                for e, v in kinds:
                    r = run_worker(e, v, model, prompts, wl, args.batches, work)
                    runs[f"{e}:{v}"].append(r)
                    shown = (
                        r["error"]
                        if "error" in r
                        else f"{statistics.median(b['wall_s'] for b in r['batches']):.3f} s/batch"
                    )
                    print(f"  {name:9s} {wl:5s} {e}:{v:6s} {shown}", flush=True)
            everything[f"{name}/{wl}"] = runs
            for label, rs in runs.items():
                ok = [r for r in rs if "error" not in r]
                if not ok:
                    err = rs[0]["error"][0]
                    hd = re.search(r"attention head size (\d+)", err)
                    why = f"vLLM's CPU kernels need head size >= 32, this model's is {hd.group(1)}" if hd else err[:120]
                    lines.append(f"| {name} | {wl} | {label} | n/a: {why} | | | | | | |")
                    continue
                wall, cpu, tokens = _med(ok, "wall_s"), _med(ok, "cpu_s"), _med(ok, "tokens")
                push = f"{_med(ok, 'sync_s'):.4f}" if label.startswith("vllm") else "-"
                start = statistics.median(r["startup_s"] for r in ok)
                lines.append(
                    f"| {name} | {wl} | {label} | {wall:.3f} | {cpu:.3f} | {push} | {tokens:.0f} | {tokens / wall:.0f} "
                    f"| {tokens / cpu:.0f} | {start:.1f} |"
                )
    print("\n" + "\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps(everything, indent=1))


if __name__ == "__main__":
    main()
