"""FSDP2's gradient reduce-scatter in float64 vs float32 at world size 2 (docs/distributed.md, "How close ...").

Replays the three local steps of tests/distributed/test_fsdp.py's grpo-token-mean case on two gloo
ranks twice, with ``MixedPrecisionPolicy(reduce_dtype=float32)`` (the default) and with
``reduce_dtype=float64`` (patched in: the config offers float32 and bfloat16), and prints how far
each run's final weights are from the single process's.

    PYTHONPATH=src python scripts/ws_reduce_dtype.py      # about 50 s on 2 cores
"""

from __future__ import annotations

import socket
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests" / "distributed")]


def rank_main(rank: int, world: int, port: int, rec: dict, out_path: str) -> None:
    import torch.distributed as dist

    import tether.distributed.parallel as parallel
    import tether.distributed.worker as worker

    torch.set_num_threads(1)
    parallel.DTYPES["float64"] = torch.float64
    settings = worker.fsdp_settings
    res = {}
    for reduce_dtype in ("float32", "float64"):
        worker.fsdp_settings = lambda cfg, rd=reduce_dtype: replace(settings(cfg), reduce_dtype=rd)
        w = worker.RankWorker(rec["cfg"], rank, world, "127.0.0.1", port, roles=("actor",))
        for s in rec["steps"]:
            w.update_actor(s["batch"], s["spec"], s["step"])
        res[reduce_dtype] = w.full_state("actor")
    if rank == 0:
        torch.save(res, out_path)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    from test_fsdp import SMALL, _record

    from tether.config import load_config

    tmp = Path(tempfile.mkdtemp())
    cfg = load_config(
        None,
        [
            *SMALL,
            "trainer.val_freq=0",
            "trainer.save_freq=0",
            "trainer.report=false",
            "trainer.loggers=[jsonl]",
            "actor.micro_batch_size=3",
            "guard.target_kl=null",
            f"trainer.output_dir={tmp / 'run'}",
        ],
    )
    rec = _record(cfg)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(rank_main, args=(2, port, rec, str(tmp / "ws2.pt")), nprocs=2, join=True)
    res = torch.load(tmp / "ws2.pt", weights_only=False)
    want = rec["actor_final"]
    print("| reduce_dtype | max abs weight diff vs world size 1 | elements > 1e-6 | elements > 1e-7 |")
    print("|---|---:|---:|---:|")
    for rd, got in res.items():
        d = torch.cat([(got[k].float() - want[k].float()).abs().flatten() for k in want])
        print(f"| {rd} | {float(d.max()):.2e} | {int((d > 1e-6).sum())} of {d.numel()} | {int((d > 1e-7).sum())} |")
    a, b = res["float32"], res["float64"]
    print(f"float64 vs float32 reduce: max abs weight diff {max(float((a[k] - b[k]).abs().max()) for k in a):.2e}")


if __name__ == "__main__":
    main()
