"""``tether eval MODEL_OR_CHECKPOINT DATA``: accuracy, response length and diversity of a policy.

The evaluation itself is :func:`tether.trainer.stats.evaluate_prompts`, the function the trainer
runs every ``trainer.val_freq`` steps; this module only loads what it needs:

* the policy: a Hugging Face model directory, a tether checkpoint (``.../checkpoints/step_N``; a
  LoRA checkpoint is loaded as base model + adapter), a run directory (its latest complete
  checkpoint), a bare peft adapter directory, or ``embedded``;
* the prompts: a verl-schema ``.jsonl``/``.json``/``.parquet`` file rendered exactly as in training
  (chat template, instruction suffix, ``max_prompt_length``);
* the reward: the built-in function of each row's ``data_source``, a user function or a reward model.

When the checkpoint belongs to a run (``<run>/config.yaml``), that run's data rendering and reward
settings are the defaults, so ``tether eval runs/x data/test.parquet`` scores exactly what the
run's validation scored; any option given on the command line wins.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tether.config import EMBEDDED, ConfigError

log = logging.getLogger("tether")


@dataclass
class EvalSettings:
    """What ``tether eval`` does. Fields left None take the run's config (if any), else the default.

    Attributes:
        k: samples per prompt (mean@k, pass@k); 1 with ``greedy``. Default 4 (= ``trainer.val_n``).
        greedy: decode greedily (then k = 1).
        temperature, top_p: sampling settings (defaults 1.0, 1.0 or the run's ``rollout.*``).
        max_new_tokens: response limit, tokens (default 512 or the run's ``rollout.max_new_tokens``).
        batch_size: prompts per generate call (``batch_size * k`` sequences).
        limit: evaluate only the first N distinct prompts.
        reward_function, reward_model: as ``reward.function`` / ``reward.model``.
        prompt_key, apply_chat_template, instruction_suffix, max_prompt_length: as ``data.*``.
        device: auto | cpu | cuda. dtype: float32 | bfloat16 | float16. seed: torch seed for sampling.
    """

    k: int | None = None
    greedy: bool = False
    temperature: float | None = None
    top_p: float | None = None
    max_new_tokens: int | None = None
    batch_size: int = 16
    limit: int | None = None
    reward_function: str | None = None
    reward_model: str | None = None
    prompt_key: str | None = None
    apply_chat_template: bool | None = None
    instruction_suffix: str | None = None
    max_prompt_length: int | None = None
    device: str = "auto"
    dtype: str = "float32"
    seed: int = 0
    resolved: dict = field(default_factory=dict)  # filled by evaluate(): the settings actually used


def resolve_policy(path: str | Path) -> tuple[Path, str, Path | None]:
    """Classify MODEL_OR_CHECKPOINT.

    Returns:
        ``(directory to load, kind, run directory or None)``; kind is ``"model"`` (a
        save_pretrained directory), ``"adapter"`` (a peft adapter directory) or ``"embedded"``.

    Raises:
        ConfigError: nothing loadable there (with what was looked for), or an incomplete checkpoint.
    """
    from tether.trainer.checkpoint import CheckpointError, latest_valid_checkpoint, verify_checkpoint

    if str(path) == EMBEDDED:
        from tether.models import resolve_model_path

        return resolve_model_path(EMBEDDED), "embedded", None
    p = Path(path).expanduser()
    if not p.exists():
        raise ConfigError(f"{p} does not exist (a model directory, a checkpoint or a run directory)")
    run = None
    if (p / "checkpoints").is_dir():  # a run directory: its latest complete checkpoint
        run = p
        ckpt = latest_valid_checkpoint(p / "checkpoints")
        if ckpt is None:
            raise ConfigError(f"run directory {p} holds no complete checkpoint")
        p = ckpt
    if (p / "actor").is_dir():  # a checkpoint
        try:
            verify_checkpoint(p)
        except CheckpointError as e:
            raise ConfigError(f"{e}") from None
        if run is None and p.parent.name == "checkpoints" and (p.parent.parent / "config.yaml").is_file():
            run = p.parent.parent
        p = p / "actor"
    if (p / "adapter_config.json").is_file():
        return p, "adapter", run
    if (p / "config.json").is_file():
        return p, "model", run
    raise ConfigError(f"{p} is neither a model directory (config.json), a peft adapter (adapter_config.json), "
                      "a tether checkpoint (actor/) nor a run directory (checkpoints/)")


def load_policy(path: str | Path, *, dtype: str = "float32", device: str = "cpu"):
    """(model, tokenizer, run directory or None) for MODEL_OR_CHECKPOINT; an adapter is merged
    into its base model (``base_model_name_or_path`` of its adapter_config.json, a local directory).

    Raises:
        ConfigError: see :func:`resolve_policy`; a tokenizer or base model that cannot be loaded.
    """
    from tether.models import DTYPES, load_causal_lm, load_tokenizer

    where, kind, run = resolve_policy(path)
    tok = load_tokenizer(where, key="MODEL_OR_CHECKPOINT")
    if kind == "adapter":
        from peft import AutoPeftModelForCausalLM

        try:
            model = AutoPeftModelForCausalLM.from_pretrained(str(where), dtype=DTYPES[dtype]).merge_and_unload()
        except (OSError, ValueError) as e:
            base = json.loads((where / "adapter_config.json").read_text()).get("base_model_name_or_path")
            raise ConfigError(f"cannot load the adapter in {where} on its base model {base!r}: {e}") from None
    elif (where.parent / "dcp").is_dir() and not any(where.glob("*.safetensors")):  # trainer.backend=ray: sharded
        from tether.export import load_sharded_actor

        model = load_sharded_actor(where.parent).to(DTYPES[dtype])
    else:
        model = load_causal_lm(where, dtype=dtype)
    model.to(device).eval()
    return model, tok, run


def _run_defaults(run: Path | None) -> dict[str, Any]:
    if run is None or not (run / "config.yaml").is_file():
        return {}
    from tether.config import load_config

    try:
        cfg = load_config(run / "config.yaml")
    except ConfigError as e:
        log.warning("tether eval: ignoring %s: %s", run / "config.yaml", e)
        return {}
    return {
        "temperature": cfg.rollout.temperature, "top_p": cfg.rollout.top_p, "max_new_tokens": cfg.rollout.max_new_tokens,
        "k": cfg.trainer.val_n, "reward_function": cfg.reward.function, "reward_model": cfg.reward.model,
        "prompt_key": cfg.data.prompt_key, "apply_chat_template": cfg.data.apply_chat_template,
        "instruction_suffix": cfg.data.instruction_suffix, "max_prompt_length": cfg.data.max_prompt_length,
    }  # fmt: skip


DEFAULTS = {"k": 4, "temperature": 1.0, "top_p": 1.0, "max_new_tokens": 512, "prompt_key": "prompt",
            "apply_chat_template": True, "instruction_suffix": "", "max_prompt_length": 2048}  # fmt: skip


def evaluate(model_or_checkpoint: str | Path, data: str | Path, settings: EvalSettings | None = None, *,
             samples: list[dict] | None = None) -> dict[str, float]:
    """Evaluate a policy on a dataset; returns the metrics of
    :func:`tether.trainer.stats.evaluate_prompts` (``pass@1``, ``mean@k``, ``pass@k``,
    ``length_mean``, diversity, ...). ``settings.resolved`` is filled with the settings used.

    Raises:
        ConfigError: a bad model/checkpoint path, bad settings, or no prompt left.
        DataError: the data file is missing or malformed (line numbers named).
        ValueError: rows whose ``data_source`` has no reward function (and none was given).
    """
    from tether.config import DataConfig
    from tether.data import load_rows
    from tether.rewards import RewardManager
    from tether.rollout import HFRolloutEngine
    from tether.trainer.prompts import prepare_prompts
    from tether.trainer.rollout import RolloutRunner
    from tether.trainer.setup import generation_eos_ids, pick_device
    from tether.trainer.stats import distinct_prompt_indices, evaluate_prompts

    s = settings or EvalSettings()
    device = pick_device(s.device)
    model, tok, run = load_policy(model_or_checkpoint, dtype=s.dtype, device=str(device))
    base = DEFAULTS | {k: v for k, v in _run_defaults(run).items() if v is not None}
    r = {name: getattr(s, name) if getattr(s, name) is not None else base.get(name) for name in
         ("k", "temperature", "top_p", "max_new_tokens", "reward_function", "reward_model", "prompt_key",
          "apply_chat_template", "instruction_suffix", "max_prompt_length")}  # fmt: skip
    if s.greedy:
        r["k"] = 1
    if r["k"] < 1 or r["max_new_tokens"] < 1 or s.batch_size < 1 or not r["temperature"] > 0 or not 0 < r["top_p"] <= 1:
        raise ConfigError(f"need k >= 1, max_new_tokens >= 1, batch_size >= 1, temperature > 0 and 0 < top_p <= 1; got {r}")
    s.resolved = r | {"greedy": s.greedy, "batch_size": s.batch_size, "device": str(device), "dtype": s.dtype, "seed": s.seed,
                      "run": str(run) if run else None}  # fmt: skip

    if str(data) in ("embedded", "embedded:val", "embedded:train"):  # the embedded task's prompts, no file needed
        from tether.data import rows_from_records
        from tether.tasks.digitsum import make_dataset

        split = str(data).partition(":")[2] or "val"
        rows = rows_from_records(make_dataset(split), source=f"embedded:{split}")
    else:
        rows = load_rows(data, prompt_key=r["prompt_key"])
    if s.limit is not None:  # render only what is evaluated: the rows of the first `limit` distinct prompts
        seen: set[str] = set()
        kept = []
        for row in rows:
            key = row.prompt if isinstance(row.prompt, str) else json.dumps(row.prompt, sort_keys=True)
            if key in seen or len(seen) < s.limit:
                seen.add(key)
                kept.append(row)
        rows = kept
    data_cfg = DataConfig(
        train_files=str(data), prompt_key=r["prompt_key"], apply_chat_template=r["apply_chat_template"],
        instruction_suffix=r["instruction_suffix"], max_prompt_length=r["max_prompt_length"], overlong_prompts="drop",
    )  # fmt: skip
    prompts = prepare_prompts(rows, tok, data_cfg, "DATA")
    indices = distinct_prompt_indices(prompts)
    if s.limit is not None:
        indices = indices[: s.limit]
    reward_model = str(Path(r["reward_model"]).expanduser()) if r["reward_model"] else None
    reward = RewardManager(function=r["reward_function"], reward_model=reward_model, device=str(device))
    reward.check_rows([prompts.rows[i] for i in indices])

    engine = HFRolloutEngine(model, tok, temperature=r["temperature"], top_p=r["top_p"], top_k=0,
                             max_new_tokens=r["max_new_tokens"], do_sample=not s.greedy)  # fmt: skip
    runner = RolloutRunner(engine, tok, device, max_new_tokens=r["max_new_tokens"], eos_token_ids=generation_eos_ids(model))
    torch.manual_seed(s.seed)
    return evaluate_prompts(runner, reward, prompts, k=r["k"], batch_size=s.batch_size, indices=indices, samples=samples)


# the table's rows, in order; other metrics follow alphabetically
_FIRST = ("pass@1", "mean@{k}", "pass@{k}", "score_mean", "length_mean", "length_max", "truncated_frac", "prompts")


def format_table(metrics: dict[str, float], settings: dict) -> str:
    """A two-column text table of the metrics, accuracy first."""
    k = settings.get("k", 1)
    first = [name.format(k=k) for name in _FIRST]
    names = list(dict.fromkeys([n for n in first if n in metrics] + sorted(m for m in metrics if m not in first)))
    width = max(len(n) for n in names)
    lines = [f"{'metric':<{width}}  value", f"{'-' * width}  ------"]
    for n in names:
        v = metrics[n]
        shown = f"{v:.0f}" if n in ("prompts", "length_max") else (f"{v:.4f}" if math.isfinite(v) else str(v))
        lines.append(f"{n:<{width}}  {shown}")
    return "\n".join(lines)


def write_json(path: str | Path, model: str, data: str, metrics: dict, settings: dict, seconds: float, samples: list | None) -> Path:
    """``{"model", "data", "settings", "metrics", "seconds"[, "samples"]}`` as indented JSON."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"model": str(model), "data": str(data), "settings": settings, "metrics": metrics, "seconds": round(seconds, 3)}
    if samples is not None:
        doc["samples"] = samples
    out.write_text(json.dumps(doc, indent=2) + "\n")
    return out


def main_eval(args) -> int:
    """The ``tether eval`` command (argparse namespace from :mod:`tether.cli`). Exit 0, or 2 on bad input."""
    import sys

    from tether.data import DataError

    s = EvalSettings(
        k=args.k, greedy=args.greedy, temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size, limit=args.limit, reward_function=args.reward_function, reward_model=args.reward_model,
        device=args.device, dtype=args.dtype, seed=args.seed,
    )  # fmt: skip
    if args.greedy and args.k not in (None, 1):
        print(f"tether eval: --greedy decodes one response per prompt; ignoring --k {args.k}", file=sys.stderr)
    samples: list[dict] | None = [] if args.samples else None
    t0 = time.perf_counter()
    try:
        metrics = evaluate(args.model, args.data, s, samples=samples)
    except (ConfigError, DataError, ValueError) as e:
        print(f"tether eval: {e}", file=sys.stderr)
        return 2
    seconds = time.perf_counter() - t0
    r = s.resolved
    mode = "greedy" if r["greedy"] else f"sampled, temperature {r['temperature']}, top_p {r['top_p']}"
    print(f"{args.model} on {args.data}: {int(metrics['prompts'])} prompts x k={r['k']} ({mode}, at most {r['max_new_tokens']} tokens), {seconds:.1f}s")
    print(format_table(metrics, r))
    if args.out:
        print(f"written to {write_json(args.out, args.model, args.data, metrics, r, seconds, samples)}")
    return 0


__all__ = ["DEFAULTS", "EvalSettings", "evaluate", "format_table", "load_policy", "main_eval", "resolve_policy", "write_json"]
