"""Where world size 2's last-bit weight differences come from (docs/distributed.md, "How close ...").

One process, no process group: the first actor update of the embedded task (the batch of
tests/distributed/test_fsdp.py's grpo-token-mean variant: 16 responses, one mini-batch, micro-batches
of 3) is replayed from the same initial weights with the gradient summed in different layouts, then
one AdamW step (grad clip 1.0, lr 3e-4) is applied to each, and the updated weights are compared:

  local       the local backend: micro-batches of 3 over the mini-batch, accumulated in order
  ws2         world size 2 emulated: each rank's token-balanced shard in micro-batches of 3, the
              ranks' partial gradients added micro-batch by micro-batch (FSDP2 reduce-scatters
              every backward: (r0_1 + r1_1) + (r0_2 + r1_2) + ...)
  local-f64   local's per-micro-batch gradients, accumulated in float64 (then rounded to float32)
  ws2-f64     ws2's per-micro-batch gradients (both ranks), accumulated in float64
  ws2-order   ws2's per-micro-batch gradients accumulated rank by rank in float32 (all of rank 0's,
              then all of rank 1's, as one process would)
  float64     the whole step in float64 (model, loss, AdamW): the exact step, to float32 rounding

    PYTHONPATH=src python scripts/ws_rounding.py      # about 20 s on one core
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from tether.config import load_config  # noqa: E402
from tether.distributed import split_batch  # noqa: E402
from tether.workers.common import micro_batches, mini_batches, optimizer_step  # noqa: E402

SMALL = [
    "trainer.total_steps=1",
    "trainer.progress=false",
    "trainer.threads=1",
    "data.batch_size=4",
    "data.embedded_train_size=8",
    "data.embedded_val_size=4",
    "rollout.n=4",
    "trainer.val_freq=0",
    "trainer.save_freq=0",
    "trainer.report=false",
    "trainer.loggers=[jsonl]",
    "actor.micro_batch_size=3",
    "guard.target_kl=null",
]


class GlobalCounts:
    """dp hooks of one rank that sees the whole mini-batch's N and S (as DataParallel.loss_counts does)."""

    def __init__(self, tokens: float, seqs: float):
        self.counts = (tokens, seqs)

    def loss_counts(self, mini):
        return self.counts

    def skip_backward(self, loss):
        raise RuntimeError("non-finite loss")


def record_first_update(out_dir: Path):
    from tether.trainer.trainer import Trainer

    cfg = load_config(None, [*SMALL, f"trainer.output_dir={out_dir}"])
    trainer = Trainer(cfg)
    actor = trainer.roles.actor
    rec = {}
    orig = actor.update

    def capture(batch, spec, step, ref=None):
        rec.update(batch=copy.deepcopy(batch), spec=spec, step=step, weights=copy.deepcopy(actor.model.state_dict()))
        return orig(batch, spec, step, ref=ref)

    actor.update = capture
    trainer.train_step()
    return trainer, rec


def per_micro_batch_grads(actor, shard, spec, counts) -> list[dict[str, torch.Tensor]]:
    """The gradient of each micro-batch's share of the mini-batch loss, one backward each."""
    from tether.algos import loss_normalizers

    out = []
    actor.dp = GlobalCounts(*counts)
    for mb in micro_batches(shard, actor.micro_batch_size):
        if float(loss_normalizers(mb.response_mask)[0]) == 0:
            continue  # a padding-only micro-batch: zero gradient
        actor.optimizer.zero_grad(set_to_none=True)
        actor._mini_batch_step(mb, spec, None)
        out.append({n: p.grad.detach().clone() for n, p in actor.model.named_parameters() if p.grad is not None})
    actor.optimizer.zero_grad(set_to_none=True)
    return out


def accumulate(grads: list[dict], dtype=torch.float32) -> dict[str, torch.Tensor]:
    total = {k: torch.zeros_like(v, dtype=dtype) for k, v in grads[0].items()}
    for g in grads:
        for k, v in g.items():
            total[k] += v.to(dtype)
    return {k: v.float() for k, v in total.items()}


def adamw_step(model, weights, grad, cfg, dtype=torch.float32) -> dict[str, torch.Tensor]:
    model = model.to(dtype)
    model.load_state_dict(weights)
    model.train()
    params = dict(model.named_parameters())
    for k, g in grad.items():
        params[k].grad = g.to(dtype, copy=True)  # clipping scales it in place
    opt = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=cfg.actor.lr,
        weight_decay=cfg.actor.weight_decay,
        betas=tuple(cfg.actor.betas),
    )
    optimizer_step(model, opt, None, cfg.actor.grad_clip)
    out = {k: p.detach().float().clone() for k, p in model.named_parameters() if p.requires_grad}
    model.float()
    return out


def main() -> None:
    import tempfile

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        trainer, rec = record_first_update(Path(tmp) / "run")
    cfg, actor, spec = trainer.cfg, trainer.roles.actor, rec["spec"]
    gen = torch.Generator().manual_seed(spec.seed * 1_000_003 + rec["step"])
    _, mini = next(mini_batches(rec["batch"], spec.mini_batch_size, gen, with_index=True))
    from tether.algos import loss_normalizers

    counts = tuple(float(x) for x in loss_normalizers(mini.response_mask))
    actor.model.load_state_dict(rec["weights"])
    local = per_micro_batch_grads(actor, mini, spec, counts)
    shards, parts = split_batch(mini, 2)
    ranks = [per_micro_batch_grads(actor, s, spec, counts) for s in shards]
    n = max(len(r) for r in ranks)
    ws2_mb = [accumulate([r[i] for r in ranks if i < len(r)]) for i in range(n)]  # one reduce-scatter per backward
    grads = {
        "local": accumulate(local),
        "ws2": accumulate(ws2_mb),
        "local-f64": accumulate(local, torch.float64),
        "ws2-f64": accumulate([g for r in ranks for g in r], torch.float64),
        "ws2-order": accumulate([g for r in ranks for g in r]),
    }
    # the exact step: model, loss and AdamW in float64
    actor.model.double()
    w64 = {k: v.double() for k, v in rec["weights"].items()}
    actor.model.load_state_dict(w64)
    g64 = accumulate(
        [{k: v.double() for k, v in g.items()} for g in per_micro_batch_grads(actor, mini, spec, counts)], torch.float64
    )
    actor.model.float()
    weights = {k: adamw_step(actor.model, rec["weights"], g, cfg) for k, g in grads.items()}
    exact = adamw_step(actor.model, w64, {k: v.double() for k, v in g64.items()}, cfg, torch.float64)
    exact_g = accumulate([g64], torch.float64)
    print(
        f"rows per rank {[len(p) for p in parts]}, micro-batches local {len(local)}, ranks {[len(r) for r in ranks]}; "
        f"lr {cfg.actor.lr}, {sum(v.numel() for v in exact.values())} trainable elements"
    )
    print(
        "| layout | max abs grad diff vs float64 | max abs weight diff vs local | elements > 1e-6 vs local | max abs "
        "weight diff vs float64 | elements > 1e-6 vs float64 |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for name, w in weights.items():
        gd = max(float((grads[name][k].double() - exact_g[k]).abs().max()) for k in exact_g)
        dl = torch.cat([(w[k] - weights["local"][k]).abs().flatten() for k in w])
        de = torch.cat([(w[k].double() - exact[k].double()).abs().flatten() for k in w])
        print(
            f"| {name} | {gd:.2e} | {float(dl.max()):.2e} | {int((dl > 1e-6).sum())} | {float(de.max()):.2e} | "
            f"{int((de > 1e-6).sum())} |"
        )
    dl = {k: (weights["ws2"][k] - weights["local"][k]).abs() for k in exact}
    worst = max(dl, key=lambda k: float(dl[k].max()))
    i = int(dl[worst].argmax())
    terms = torch.stack([g[worst].flatten()[i] for g in local])
    print(
        f"worst element ws2 vs local: {worst}[{i}]: |g| = {float(exact_g[worst].flatten()[i].abs()):.3e} (float64), "
        f"per-micro-batch terms up to {float(terms.abs().max()):.3e}, local / ws2 g = "
        f"{float(grads['local'][worst].flatten()[i]):.6e} / {float(grads['ws2'][worst].flatten()[i]):.6e}, weight diff "
        f"{float(dl[worst].max()):.2e}"
    )


if __name__ == "__main__":
    main()
