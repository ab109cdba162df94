"""Memory of the reference policy: LoRA with the adapter-disabled reference vs a separate copy.

Each variant runs in a fresh subprocess: a tiny random Qwen2 model (default hidden 512, 8 layers,
~21M parameters, float32) is trained for one GRPO step by the real trainer (``tether.trainer.Trainer``),
then the process reports

* ``weights MB``: bytes of every distinct parameter tensor held by the actor, the reference and
  the critic (shared storage counted once),
* ``Adam MB``: the AdamW state (exp_avg, exp_avg_sq) of the trainable parameters,
* ``RSS MB``: resident set size after the step minus the RSS before the Trainer was built
  (imports excluded), and the peak (VmHWM) minus the same baseline, from /proc/self/status.

Variants:
  full+copy   full fine-tuning, reference = a frozen copy (actor.lora.rank=0)
  lora+copy   LoRA adapters, reference = a separate frozen copy of the base (what you would pay
              without the adapter-disabled reference)
  lora        LoRA adapters, reference = the same model with the adapters disabled (tether's way)

    python benchmarks/bench_lora_memory.py [--hidden 512] [--layers 8] [--rank 8]

Linux only (reads /proc/self/status). Takes ~1 minute on one CPU core.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REWARD = """
def digits(data_sources, solution_strs, ground_truths, extra_infos):
    return [sum(c.isdigit() for c in s) / max(len(s), 1) for s in solution_strs]
"""


def _status_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024  # kB → MiB
    raise RuntimeError(f"{field} not in /proc/self/status")


def _tensor_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        key = (t.untyped_storage().data_ptr(), t.device)
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def child(variant: str, model_dir: str, data: str, reward: str, out_dir: str, rank: int) -> dict:
    import torch

    from tether.config import load_config
    from tether.models import load_causal_lm
    from tether.trainer import Trainer
    from tether.workers import ReferenceWorker

    torch.set_num_threads(1)
    overrides = [
        f"actor.model={model_dir}",
        f"data.train_files={data}",
        f"reward.function={reward}:digits",
        f"trainer.output_dir={out_dir}",
        "trainer.total_steps=1",
        "trainer.save_freq=0",
        "trainer.val_freq=0",
        "trainer.report=false",
        "trainer.progress=false",
        "trainer.loggers=[jsonl]",
        "trainer.threads=1",
        "data.batch_size=2",
        "rollout.n=2",
        "rollout.max_new_tokens=16",
        "algo.mini_batch_size=4",
        "actor.micro_batch_size=4",
        f"actor.lora.rank={0 if variant == 'full+copy' else rank}",
        "actor.lora.alpha=16",
        "trainer.resume=off",
    ]
    cfg = load_config(None, overrides)
    base_rss = _status_mb("VmRSS")
    t = Trainer(cfg)
    if variant == "lora+copy":  # the alternative tether avoids: a second, frozen copy of the base model
        t.roles.ref = ReferenceWorker(
            load_causal_lm(t.roles.actor_path), micro_batch_size=4, temperature=cfg.rollout.temperature
        )
    t.ckpt.maybe_save = lambda *a, **k: None  # measure the models, not checkpoint writing
    t.fit()
    roles = t.roles
    params = list(roles.actor.model.parameters())
    if roles.ref.model is not None:
        params += list(roles.ref.model.parameters())
    if roles.critic is not None:
        params += list(roles.critic.model.parameters())
    adam = [v for st in roles.actor.optimizer.state.values() for v in st.values() if torch.is_tensor(v) and v.dim() > 0]
    return {
        "variant": variant,
        "trainable": sum(p.numel() for p in roles.actor.model.parameters() if p.requires_grad),
        "total_params": sum(p.numel() for p in roles.actor.model.parameters()),
        "weights_mb": _tensor_bytes(params) / 2**20,
        "adam_mb": _tensor_bytes(adam) / 2**20,
        "rss_mb": _status_mb("VmRSS") - base_rss,
        "peak_mb": _status_mb("VmHWM") - base_rss,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--json", default=None, help="also write the rows as JSON here")
    ap.add_argument("--child", nargs=6, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        variant, model_dir, data, reward, out_dir, rank = a.child
        print("RESULT " + json.dumps(child(variant, model_dir, data, reward, out_dir, int(rank))))
        return 0

    from tether.data import write_records
    from tether.testing import build_gsm8k_tokenizer, build_tiny_causal_lm, synthetic_math_texts

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        tok = build_gsm8k_tokenizer(root / "tok", texts=synthetic_math_texts())
        model = build_tiny_causal_lm(root / "model", tok, arch="qwen2", hidden=a.hidden, layers=a.layers, heads=a.heads)
        write_records(
            [
                {"prompt": [{"role": "user", "content": t.split("\n")[0]}], "data_source": "x"}
                for t in synthetic_math_texts(8)
            ],
            root / "data.jsonl",
        )
        (root / "reward.py").write_text(REWARD)
        rows = []
        for variant in ("full+copy", "lora+copy", "lora"):
            cmd = [
                sys.executable,
                __file__,
                "--child",
                variant,
                str(model),
                str(root / "data.jsonl"),
                str(root / "reward.py"),
                str(root / variant),
                str(a.rank),
            ]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            rows.append(json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:]))
    n = rows[0]["total_params"]
    print(
        f"tiny Qwen2: hidden {a.hidden}, {a.layers} layers, {n / 1e6:.1f}M parameters, float32; LoRA rank {a.rank} on "
        "all linear layers; one GRPO step"
    )
    print()
    print("| variant | trainable params | weights MB (actor+ref) | Adam MB | RSS MB after step | peak RSS MB |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(
            f"| {r['variant']} | {r['trainable'] / 1e6:.2f}M | {r['weights_mb']:.1f} | {r['adam_mb']:.1f} | "
            f"{r['rss_mb']:.0f} | {r['peak_mb']:.0f} |"
        )
    lora, copy_ = rows[2], rows[1]
    print()
    print(
        f"adapter-disabled reference saves {copy_['weights_mb'] - lora['weights_mb']:.1f} MB of weights "
        f"({(copy_['weights_mb'] - lora['weights_mb']) / copy_['weights_mb']:.0%} of lora+copy) and "
        f"{copy_['rss_mb'] - lora['rss_mb']:.0f} MB RSS; vs full fine-tuning with a copy: "
        f"{rows[0]['weights_mb'] + rows[0]['adam_mb'] - lora['weights_mb'] - lora['adam_mb']:.1f} MB of weights + Adam "
        "state"
    )
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
