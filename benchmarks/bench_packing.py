"""Padded vs padding-free micro-batches, and token-budget micro-batching, on a GSM8K-shaped batch (issue 13, item 4).

    python benchmarks/bench_packing.py [--rounds 3] [--repeats 2] [--budget 8192]

The batch: 64 responses (8 prompts × G = 8) to prompts of 120-180 tokens (uniform, left-padded
to 180), response lengths min(Geometric(1/110), 256) (right-padded to the longest), the shape of
``bench_peer_trl.py --extra``'s GSM8K-shaped workload; its small Qwen2 (vocab 2000, hidden 256,
8 layers, ~5.2M parameters, fp32, one thread, CPU). Token values are random: cost does not depend
on them.

Per variant, each in a fresh process, alternating variants round by round (A B C D A B C D ...):
the no-grad log-prob pass (``ActorWorker.compute_logprobs``: what the old and reference passes
run) and one actor update (one mini-batch of 64: forward, backward, AdamW step; k3 KL loss),
each timed ``--repeats`` times after a warm-up, wall and process CPU time. Printed: medians over
all rounds and repeats, the positions each variant's forwards compute (the padded layout's
rows × width, the packed layout's rows × row length), and the masked mean log-prob (the same in
every variant, to the last digits shown).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE.parent))

N_ROWS, P_RANGE, T_MAX, MEAN_LEN = 64, (120, 180), 256, 110


def variants(budget: int) -> dict[str, list[str]]:
    return {
        "padded (64 rows)": [],
        f"padded, budget {budget}": [f"max_tokens={budget}"],
        "padding-free (64 rows)": ["padding_free"],
        f"padding-free, budget {budget}": ["padding_free", f"max_tokens={budget}"],
    }


def make_batch(vocab: int, seed: int = 0):
    import torch

    from tether.batch import RolloutBatch
    from tether.data import PromptRow

    g = torch.Generator().manual_seed(seed)
    # a group shares its prompt
    plen = torch.randint(P_RANGE[0], P_RANGE[1] + 1, (N_ROWS // 8,), generator=g).repeat_interleave(8)
    u = torch.rand(N_ROWS, generator=g)
    rlen = (torch.log1p(-u) / torch.log1p(torch.tensor(-1.0 / MEAN_LEN))).ceil().clamp(1, T_MAX).long()
    P, T = int(plen.max()), int(rlen.max())
    pm = (torch.arange(P)[None] >= P - plen[:, None]).long()
    rm = (torch.arange(T)[None] < rlen[:, None]).long()
    b = RolloutBatch(
        prompt_ids=torch.randint(3, vocab, (N_ROWS, P), generator=g) * pm,
        prompt_mask=pm,
        response_ids=torch.randint(3, vocab, (N_ROWS, T), generator=g) * rm,
        response_mask=rm,
        group_ids=torch.arange(N_ROWS) // 8,
        rows=[PromptRow("p", "bench", None, {}, 0)] * N_ROWS,
        prompts=[""] * N_ROWS,
        responses=[""] * N_ROWS,
    )
    b.advantages = torch.randn(N_ROWS, T, generator=g) * rm
    return b


def positions(micro, batch) -> int:
    """Token positions the forwards of one pass compute under ``micro`` (padding included)."""
    total = 0
    for _, _, lay in micro.split(batch):
        total += lay.input_ids.numel() if hasattr(lay, "input_ids") else lay.ids.numel()
    return total


def worker(args) -> dict:
    import torch

    torch.set_num_threads(1)
    from bench_peer_trl import build_model
    from transformers import AutoModelForCausalLM

    from tether.workers import ActorWorker
    from tether.workers.actor import ActorUpdateSpec
    from tether.workers.packing import MicroBatching

    opts = dict(o.split("=") if "=" in o else (o, "1") for o in args.opts)
    model_dir = build_model(Path(args.workdir) / "qwen2-small-gsm", "small", eos_logit_boost=0.8)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    batch = make_batch(model.config.vocab_size)
    micro = MicroBatching(64, int(opts["max_tokens"]) if "max_tokens" in opts else None, "padding_free" in opts)
    actor = ActorWorker(
        model,
        lr=1e-5,
        weight_decay=0.0,
        betas=(0.9, 0.999),
        warmup_steps=0,
        grad_clip=1.0,
        micro_batch_size=micro.size,
        temperature=1.0,
        max_tokens_per_micro_batch=micro.max_tokens,
        padding_free=micro.padding_free,
    )
    spec = ActorUpdateSpec(
        ppo_epochs=1,
        mini_batch_size=N_ROWS,
        clip_eps_low=0.2,
        clip_eps_high=0.2,
        dual_clip_c=3.0,
        loss_agg_mode="token-mean",
        entropy_coef=0.0,
        kl_loss_coef=0.04,
        kl_loss_estimator="k3",
        kl_loss_agg_mode="token-mean",
        log_ratio_clamp=20.0,
        value_clamp=10.0,
        target_kl=None,
        seed=0,
        norm_constant=float(T_MAX),
    )
    lp = actor.compute_logprobs(batch.select(list(range(4))), with_entropy=False)[0]  # warm-up
    lp = actor.compute_logprobs(batch, with_entropy=False)[0]
    mask = batch.response_mask
    mean_lp = float((lp * mask).sum() / mask.sum())
    batch.old_logprobs = lp.detach() + 0.01 * torch.randn(lp.shape, generator=torch.Generator().manual_seed(1)) * mask
    batch.ref_logprobs = lp.detach()
    out = {"nograd_s": [], "nograd_cpu": [], "update_s": [], "update_cpu": []}
    for r in range(args.repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        actor.compute_logprobs(batch, with_entropy=False)
        out["nograd_s"].append(time.perf_counter() - t0)
        out["nograd_cpu"].append(time.process_time() - c0)
        t0, c0 = time.perf_counter(), time.process_time()
        m = actor.update(batch, spec, step=r)
        out["update_s"].append(time.perf_counter() - t0)
        out["update_cpu"].append(time.process_time() - c0)
    out["mean_lp"] = mean_lp
    out["loss"] = m["policy/loss"]
    out["positions"] = positions(micro, batch)
    out["valid"] = int(batch.prompt_mask.sum() + mask.sum())
    out["micro_batches"] = len(micro.groups(batch))
    out["mean_response"] = float(mask.sum(-1).float().mean())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--rounds", type=int, default=3, help="rounds of fresh processes, one per variant each, alternating"
    )
    ap.add_argument("--repeats", type=int, default=2, help="timed passes per process")
    ap.add_argument(
        "--budget", type=int, default=8192, help="max_tokens_per_micro_batch of the budget variants, tokens"
    )
    ap.add_argument("--workdir", default=str(ROOT / ".tmp" / "bench_peer"))
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--opts", nargs="*", default=[])
    ap.add_argument("--result")
    args = ap.parse_args()
    if args.worker:
        Path(args.result).write_text(json.dumps(worker(args)))
        return
    vs = variants(args.budget)
    runs: dict[str, list[dict]] = {k: [] for k in vs}
    res = Path(args.workdir) / "bench_packing_result.json"
    res.parent.mkdir(parents=True, exist_ok=True)
    env = os.environ | {
        "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "OMP_NUM_THREADS": "1",
    }
    print(
        f"# load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; {args.rounds} rounds x {args.repeats} "
        "repeats",
        flush=True,
    )
    for _ in range(args.rounds):
        for name, opts in vs.items():
            cmd = [
                sys.executable,
                str(HERE),
                "--worker",
                "--workdir",
                args.workdir,
                "--repeats",
                str(args.repeats),
                "--result",
                str(res),
                "--opts",
                *opts,
            ]
            subprocess.run(cmd, check=True, env=env)
            runs[name].append(json.loads(res.read_text()))
            r = runs[name][-1]
            print(
                f"  {name:28s} no-grad {statistics.median(r['nograd_cpu']):.2f} CPU s, update "
                f"{statistics.median(r['update_cpu']):.2f} CPU s",
                flush=True,
            )
    med = {
        n: {
            k: statistics.median([x for r in rs for x in r[k]])
            for k in ("nograd_s", "nograd_cpu", "update_s", "update_cpu")
        }
        for n, rs in runs.items()
    }
    base = med[next(iter(vs))]
    first = runs[next(iter(vs))][0]
    print(
        f"\n{N_ROWS} rows, prompts {P_RANGE[0]}-{P_RANGE[1]} tokens, responses 1-{T_MAX} (mean "
        f"{first['mean_response']:.0f}); {first['valid']} valid tokens\n"
    )
    print(
        "| variant | micro-batches | positions computed (padding) | no-grad pass CPU s (wall) | update CPU s (wall) | "
        "no-grad speed-up (CPU) | update speed-up (CPU) | mean log-prob | loss |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for n, rs in runs.items():
        r, m = rs[0], med[n]
        pad = 1 - r["valid"] / r["positions"]
        print(
            f"| {n} | {r['micro_batches']} | {r['positions']} ({pad:.0%}) | {m['nograd_cpu']:.2f} "
            f"({m['nograd_s']:.2f}) | {m['update_cpu']:.2f} ({m['update_s']:.2f}) | "
            f"{base['nograd_cpu'] / m['nograd_cpu']:.2f}x | {base['update_cpu'] / m['update_cpu']:.2f}x | "
            f"{r['mean_lp']:.6f} | {r['loss']:.7f} |"
        )


if __name__ == "__main__":
    main()
