"""The ``tether`` command line: argument parsing and config loading, nothing else."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

USAGE = """tether: KL-regularized RL from feedback for language models

  tether train [CONFIG.yaml] [key=value ...]   train (no arguments: the embedded digit-sum task)
  tether sft [--out DIR] [--seed N] [--steps N] train the embedded task's reference policy
                                                (default: into runs/sft-reference)
  tether report RUN_DIR                         plots + summary.md of a run
  tether doctor RUN_DIR                         health checks of a run's metrics
  tether view RUN_DIR [--port N] [--html FILE]  read the rollout records token by token (trainer.log_rollouts)
  tether export CHECKPOINT_OR_RUN OUT_DIR       a Hugging Face save_pretrained directory
  tether data gsm8k SRC OUT                     convert GSM8K jsonl to verl's schema
  tether data gsm8k-solutions SRC OUT           GSM8K model solutions → offline rows (response, score)
  tether data aime|gpqa|math500 SRC OUT         benchmark files → verl's schema with their prompt templates
  tether eval MODEL_OR_CHECKPOINT DATA [--n N] [--k 1,4,16] [--checkpoints all] [--out FILE]  pass@k, maj@k, KL, length
  tether sweep [SPEC.yaml] [--grid K=V1,V2 ...] [key=value ...]  a grid of train runs, table + plots
  tether plan [CONFIG.yaml] [key=value ...] --devices N --device-memory 80GiB  memory per device, fits or not
"""


def _setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    for noisy in ("transformers", "torch", "urllib3", "matplotlib", "PIL"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:
        pass


def cmd_train(args: argparse.Namespace) -> int:
    from tether.config import ConfigError, describe_config, load_config

    if args.help_config:
        print(describe_config())
        return 0
    config, overrides = args.config, list(args.overrides)
    if config is not None and "=" in config and not config.endswith((".yaml", ".yml")):
        overrides.insert(0, config)
        config = None
    if config is not None and not Path(config).exists() and not config.endswith((".yaml", ".yml")):
        print(
            f"tether train: {config!r} is neither a config file (no such file) nor an override: an override needs "
            f"key=value, e.g. {config}=VALUE (tether train --help-config lists every key)",
            file=sys.stderr,
        )
        return 2
    try:
        cfg = load_config(config, overrides)
    except ConfigError as e:
        print(f"tether train: {e}", file=sys.stderr)
        return 2
    from tether.checkpoint import CheckpointWriteError
    from tether.trainer import Trainer, TrainingInterrupted, TrainingStopped

    try:
        trainer = Trainer(cfg)
    except ValueError as e:  # ConfigError, DataError, a reward registry error: all name the offending item
        print(f"tether train: {e}", file=sys.stderr)
        return 2
    print(f"run directory: {trainer.run_dir}", file=sys.stderr)
    try:
        trainer.fit()
    except TrainingStopped as e:
        print(f"tether train: stopped by a guard: {e}", file=sys.stderr)
        return 3
    except CheckpointWriteError as e:  # a full or read-only disk: one line, the resume point, the command
        if worker_failure(e):  # a rank that died while writing its shard: not the disk's fault
            return _worker_failed(e.__cause__, trainer, config, overrides)
        print(
            f"tether train: {e.strerror}; {_last_checkpoint(trainer)}. To continue once the disk is fixed:\n  "
            f"{resume_command(config, overrides, trainer.run_dir)}",
            file=sys.stderr,
        )
        return 4
    except KeyboardInterrupt as e:  # TrainingInterrupted (SIGTERM/SIGINT, tether.signals) or a bare Ctrl-C
        saved = trainer.ckpt.checkpoints()
        if isinstance(e, TrainingInterrupted) and e.step is not None:
            from tether.signals import signal_name

            what = f"stopped by {signal_name(e.signum)} after step {e.step}; checkpoint step {e.step} written"
        else:
            what = f"interrupted at step {trainer.step}; " + (
                f"the last checkpoint is step {saved[-1]}" if saved else "no checkpoint was written yet"
            )
        again = (
            "To continue"
            if saved or (isinstance(e, TrainingInterrupted) and e.step is not None)
            else "To start again (from step 0)"
        )
        print(
            f"\ntether train: {what}. {again}:\n  {resume_command(config, overrides, trainer.run_dir)}", file=sys.stderr
        )
        return e.exit_code if isinstance(e, TrainingInterrupted) else 130
    except Exception as e:
        if not worker_failure(e):
            raise  # a bug: its traceback
        return _worker_failed(e, trainer, config, overrides)
    print(f"done: {trainer.run_dir}", file=sys.stderr)
    summary = train_summary(trainer.run_dir, getattr(getattr(trainer, "guard", None), "tried", None))
    if summary:
        print(f"  {summary}", file=sys.stderr)
    return 0


#: ``tether train``'s exit status when a Ray worker (a rank of a worker group, an engine replica) died or failed
WORKER_FAILED_EXIT = 5


def worker_failure(e: BaseException) -> bool:
    """Whether ``e`` is a Ray worker's death or failure (``WorkerDiedError``, or Ray's own error where a call is not
    wrapped), also under a checkpoint write that found no OS reason (a rank died while writing its shard)."""
    from tether.checkpoint import CheckpointWriteError
    from tether.distributed.errors import WorkerDiedError

    if isinstance(e, CheckpointWriteError):
        return not e.errno and e.__cause__ is not None and worker_failure(e.__cause__)
    return isinstance(e, WorkerDiedError) or type(e).__module__.startswith("ray.")


def _last_checkpoint(trainer) -> str:
    saved = trainer.ckpt.checkpoints()
    return f"the last complete checkpoint is step {saved[-1]}" if saved else "no checkpoint was written yet"


def _worker_failed(e: BaseException, trainer, config: str | None, overrides: list[str]) -> int:
    """A Ray worker died or failed mid-run (killed, out of memory, a lost node): one line saying which, the resume
    point and the command that continues (re-running it starts fresh workers from that checkpoint)."""
    saved = trainer.ckpt.checkpoints()
    what = str(e).splitlines()[0] if str(e) else type(e).__name__
    print(
        f"tether train: {what}; {_last_checkpoint(trainer)}. "
        f"{'To continue' if saved else 'To start again (from step 0)'}:\n  "
        f"{resume_command(config, overrides, trainer.run_dir)}",
        file=sys.stderr,
    )
    return WORKER_FAILED_EXIT


def train_summary(run_dir, rollbacks=None) -> str:
    """One line on how a finished run ended, from its ``metrics.jsonl``: the last validation's exact success rate
    (``exact/score_mean``, the reference's at step 0 beside it) and KL per token (``exact/kl_ref_tok``) on the
    embedded task, else its ``val/score_mean`` (and the sampled gold ``val/gold_mean`` beside it, named by what
    scored it: ``reward.val_function``, ``reward.val_model`` or the data's built-in gold, from the run's
    ``config.yaml``) and the last step's ``kl/ref_mean``; and where ``report/summary.md`` is.
    When a gold is logged beside the training reward (``exact/gold_mean``: ``reward.function`` or a hack task, whose
    ``exact/score_mean`` is the proxy's mean), the success quoted is the gold's and the training reward follows it
    under its own label.

    ``rollbacks``: the guard's ``[step, restored step, β]`` of each rollback (``Guard.tried``). When the last
    validation rolled back (the run ends on the restored checkpoint's weights, e.g. step 60 → step 50), the line says
    so and quotes the restored step's validation (``step 60: rolled back to step 50's weights: ...``), not the
    discarded weights'; the line then says how many rollbacks there were and the β after the last.
    "" when the run has no metrics to quote."""
    from pathlib import Path

    from tether.diagnostics import load_run_config, read_metrics

    try:
        recs = read_metrics(run_dir)
    except OSError:
        return ""
    vals = [r for r in recs if isinstance(r.get("exact/score_mean", r.get("val/score_mean")), (int, float))]
    kls = [r for r in recs if isinstance(r.get("kl/ref_mean"), (int, float))]
    parts = []
    kl_note = "last training batch"
    if vals:
        last, ref = vals[-1], vals[0]
        head = f"step {last['step']}"
        back = next((int(r[1]) for r in rollbacks or () if r[0] == last["step"]), None)
        if back is not None:  # the weights it validated were discarded: describe the restored ones
            head += f": rolled back to step {back}'s weights"
            kept = [r for r in vals[:-1] if r["step"] == back]
            last = kept[-1] if kept else None
            kls = [r for r in kls if r["step"] == back]
            kl_note = f"step {back}'s training batch"
        if last is None:
            parts.append(f"{head} (no validation of them logged)")
        elif "exact/score_mean" in last:
            if isinstance(last.get("exact/gold_mean"), (int, float)):  # r is a proxy: success is the gold's
                gold_ref = ref.get("exact/gold_mean") if ref["step"] == 0 and ref is not last else None
                was = f" (reference {gold_ref:.3f})" if isinstance(gold_ref, (int, float)) else ""
                parts.append(f"{head}: exact success (gold) {last['exact/gold_mean']:.3f}{was}")
                was = f" (reference {ref['exact/score_mean']:.3f})" if ref["step"] == 0 and ref is not last else ""
                parts.append(f"exact training reward {last['exact/score_mean']:.3f}{was}")
            else:
                was = f" (reference {ref['exact/score_mean']:.3f})" if ref["step"] == 0 and ref is not last else ""
                parts.append(f"{head}: exact success {last['exact/score_mean']:.3f}{was}")
            if isinstance(last.get("exact/kl_ref_tok"), (int, float)):
                parts.append(f"KL {last['exact/kl_ref_tok']:.3f} nats/token")
        else:
            was = f" (reference {ref['val/score_mean']:.3f})" if ref["step"] == 0 and ref is not last else ""
            text = f"{head}: validation score {last['val/score_mean']:.3f}{was}"
            if isinstance(last.get("val/gold_mean"), (int, float)):  # a sampled gold: beside the proxy's score
                gold_ref = ref.get("val/gold_mean") if ref["step"] == 0 and ref is not last else None
                was = f" (reference {gold_ref:.3f})" if isinstance(gold_ref, (int, float)) else ""
                text += f", gold{_gold_source(load_run_config(Path(run_dir)))} {last['val/gold_mean']:.3f}{was}"
            parts.append(text)
    if kls and not any("KL" in p for p in parts):
        parts.append(f"KL {kls[-1]['kl/ref_mean']:.3f} nats/token ({kl_note})")
    if rollbacks and parts:  # what the guard did, and the β the run ended with (set by its last rollback)
        n = len(rollbacks)
        parts.append(f"{n} rollback{'s' if n > 1 else ''} by the guard, β {float(rollbacks[-1][2]):.4g} after the last")
    report = Path(run_dir) / "report" / "summary.md"
    if report.is_file():
        parts.append(f"report: {report}")
    return "; ".join(parts)


def _gold_source(cfg) -> str:
    """`` (reward.val_function)``, `` (reward.val_model)`` or `` (the data's built-in gold)``: what scored a run's
    ``val/gold_mean``, from its config mapping; "" when the config is missing."""
    reward = cfg.get("reward") if cfg is not None else None
    if not isinstance(reward, dict):
        return ""
    for key in ("val_function", "val_model"):
        if reward.get(key):
            return f" (reward.{key})"
    return " (the data's built-in gold)"


def resume_command(config: str | None, overrides: list[str], run_dir) -> str:
    """The ``tether train`` command that continues a run: the same config and overrides, with
    ``trainer.output_dir`` pointing at the run (``trainer.resume=auto`` picks its latest checkpoint)."""
    import shlex

    kept = [o for o in overrides if not o.lstrip("+").startswith("trainer.output_dir=")]
    return shlex.join(["tether", "train", *([config] if config else []), *kept, f"trainer.output_dir={run_dir}"])


def cmd_sft(args: argparse.Namespace) -> int:
    from tether.outputs import output_problem
    from tether.tasks.sft import DEFAULT_STEPS, build_reference, default_reference_path

    out = Path(args.out or SFT_DEFAULT_OUT)  # never the shipped reference unless asked by name (--out)
    if problem := output_problem(out, "dir", "--out"):
        print(f"tether sft: {problem}", file=sys.stderr)
        return 2
    # a reference is replaced, nothing else
    if out.is_dir() and any(out.iterdir()) and not (out / "model.safetensors").is_file():
        print(
            f"tether sft: --out {out} holds files but no model.safetensors (not a reference to rebuild): choose an "
            "empty or new directory",
            file=sys.stderr,
        )
        return 2
    kwargs = {"seed": args.seed}
    if args.steps is not None:
        if args.steps < 1:
            print(f"tether sft: --steps must be at least 1, got {args.steps}", file=sys.stderr)
            return 2
        kwargs["steps"] = args.steps
    steps = kwargs.get("steps", DEFAULT_STEPS)
    shipped = out.resolve() == default_reference_path().resolve()
    print(
        f"tether sft: {steps} SFT steps into {out}{' (the shipped reference)' if shipped else ''}, about "
        f"{steps / 20:.0f} s on one core; the loss is printed every 250 steps",
        file=sys.stderr,
    )
    path = build_reference(out, log_every=250, **kwargs)
    print(f"reference policy written to {path}")
    if not shipped:
        print(f"use it: tether train actor.model={path}  (the shipped one is {default_reference_path()})")
    return 0


#: where ``tether sft`` writes without ``--out``: a new directory, not the reference the package ships
SFT_DEFAULT_OUT = "runs/sft-reference"


def cmd_report(args: argparse.Namespace) -> int:
    """Exit 0; 2 when RUN_DIR is not a run or its report/ cannot be written (found before drawing); 4 when
    a write fails (full or read-only disk): one line, and an earlier report is left as it was."""
    from tether.outputs import OutputPathError, OutputWriteError
    from tether.report import write_report

    try:
        out = write_report(args.run_dir)
    except OutputWriteError as e:
        print(f"tether report: {e}", file=sys.stderr)
        return 4
    except (FileNotFoundError, OutputPathError) as e:
        print(f"tether report: {e}", file=sys.stderr)
        return 2
    print(f"report written to {out}")
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    from tether.diagnostics import doctor

    return doctor(args.run_dir)


def cmd_view(args: argparse.Namespace) -> int:
    """Exit 0; 2 for a run that cannot be shown or a port in use (one line); 4 when --html cannot be written."""
    from tether.outputs import OutputWriteError
    from tether.viewer import ViewError, serve, write_html

    try:
        if args.html:
            out = write_html(args.run_dir, args.html)
            print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB; opens offline)")
            return 0
        serve(args.run_dir, args.port, open_browser=args.open)
    except ViewError as e:
        print(f"tether view: {e}", file=sys.stderr)
        return 2
    except OutputWriteError as e:
        print(f"tether view: {e}", file=sys.stderr)
        return 4
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """Exit 0; 2 for a bad checkpoint or OUT_DIR (found before writing); 4 when a write fails (full or
    read-only disk): one line, and nothing left at or beside OUT_DIR."""
    from tether.checkpoint import CheckpointError
    from tether.export import export_checkpoint
    from tether.outputs import OutputWriteError

    try:
        out = export_checkpoint(args.checkpoint, args.out_dir)
    except OutputWriteError as e:
        print(f"tether export: {e}", file=sys.stderr)
        return 4
    except CheckpointError as e:
        print(f"tether export: {e}", file=sys.stderr)
        return 2
    print(f"exported to {out}")
    return 0


def cmd_data(args: argparse.Namespace) -> int:
    from tether.data import DataError, convert_gsm8k

    try:
        n = convert_gsm8k(
            Path(args.src), Path(args.out), **({"instruction_suffix": args.suffix} if args.suffix is not None else {})
        )
    except DataError as e:
        print(f"tether data: {e}", file=sys.stderr)
        return 2
    print(f"wrote {n} rows to {args.out}")
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    from tether.sweep import main_sweep

    items = list(args.items)
    spec = items.pop(0) if items and items[0].endswith((".yaml", ".yml")) and "=" not in items[0] else None
    return main_sweep(
        spec,
        args.grid,
        items,
        out=args.out,
        workers=args.workers,
        tail=args.tail,
        exact_final=args.exact_final,
        dry_run=args.dry_run,
        table_only=args.table_only,
    )


def _add_sweep_parser(sub) -> None:
    w = sub.add_parser("sweep", help="run a grid of train configs in parallel (resumable); table and plots")
    w.add_argument("items", nargs="*", help="optional SPEC.yaml first, then fixed key=value overrides for every run")
    w.add_argument(
        "--grid", action="append", default=[], metavar="KEY=V1,V2", help="a grid axis (repeatable); runs = the product"
    )
    w.add_argument("--out", default=None, help="sweep directory (default runs/sweep); one subdirectory per run")
    w.add_argument("--workers", type=int, default=None, help="parallel runs (default: the number of cores)")
    w.add_argument("--tail", type=int, default=None, help="steps averaged for the table's sampled columns (default 20)")
    w.add_argument(
        "--exact-final",
        choices=["none", "val", "train", "all"],
        default=None,
        help="exact evaluation of each final checkpoint on these prompts (default all)",
    )
    w.add_argument("--dry-run", action="store_true", help="print the commands and which runs are finished")
    w.add_argument("--table-only", action="store_true", help="only (re)write the table and plots from existing runs")
    w.set_defaults(func=cmd_sweep)


def cmd_eval(args: argparse.Namespace) -> int:
    """Exit 0; 2 on bad input (an unwritable --out among it, found before evaluating); 4 when writing
    --out fails (full or read-only disk): see :func:`tether.evaluation.evaluate.main_eval`."""
    from tether.evaluation.evaluate import main_eval

    return main_eval(args)


def _add_eval_parser(sub) -> None:
    v = sub.add_parser(
        "eval",
        help="pass@k, maj@k, mean@n, KL to the reference, response length and diversity of a model, checkpoint or run",
    )
    v.add_argument(
        "model",
        metavar="MODEL_OR_CHECKPOINT",
        help="model directory, checkpoint (step_N), run directory, or 'embedded'",
    )
    v.add_argument(
        "data",
        metavar="DATA",
        help="prompts in verl's schema (.jsonl/.json/.parquet), or embedded[:val|:train] for the digit-sum task's "
        "prompts",
    )
    v.add_argument(
        "--n",
        type=int,
        default=None,
        help="samples per prompt (default 4, the run's trainer.val_n, or the largest --k)",
    )
    v.add_argument("--k", default=None, help="comma-separated k of pass@k and maj@k, each <= n (default 1,2,4,...,n)")
    v.add_argument(
        "--checkpoints",
        default=None,
        metavar="all|latest|STEPS",
        help="with a run directory: evaluate these checkpoints and the reference (step 0); writes "
        "RUN_DIR/eval/curve.png",
    )
    v.add_argument("--greedy", action="store_true", help="greedy decoding, one response per prompt")
    v.add_argument("--temperature", type=float, default=None, help="sampling temperature (default 1.0, or the run's)")
    v.add_argument("--top-p", type=float, default=None, help="nucleus sampling threshold (default 1.0, or the run's)")
    v.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help="response limit in tokens (default 512, 4 for DATA=embedded, or the run's)",
    )
    v.add_argument("--batch-size", type=int, default=16, help="prompts per generate call (batch-size x n sequences)")
    v.add_argument("--limit", type=int, default=None, help="only the first N distinct prompts")
    v.add_argument(
        "--reward-function",
        default=None,
        help="file.py:name or module:name, scoring every row (default: each row's built-in verifier by data_source, "
        "else the run's reward.function)",
    )
    v.add_argument(
        "--reward-model",
        default=None,
        help="a local sequence-classification reward model directory, scoring every row "
        "(default: as --reward-function)",
    )
    v.add_argument(
        "--val-function",
        default=None,
        help="gold reward, file.py:name or module:name (reward.val_function), scoring the same samples: gold_mean, "
        "gold_gap (default: the run's reward.val_function / val_model, else each row's built-in gold)",
    )
    v.add_argument(
        "--val-model",
        default=None,
        help="gold reward, a local sequence-classification reward model directory (reward.val_model; default: as "
        "--val-function)",
    )
    v.add_argument(
        "--engine",
        default="auto",
        help="rollout engine: auto (the run's rollout.engine, else HF generate) or a rollout.engine name (tether train "
        "--help-config lists them)",
    )
    v.add_argument(
        "--ref", default=None, help="reference model directory for the KL (default: the run's ref.model or actor.model)"
    )
    v.add_argument(
        "--no-kl", action="store_true", help="skip the KL to the reference (saves two forward passes per batch)"
    )
    v.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    v.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    v.add_argument("--seed", type=int, default=0)
    v.add_argument("--no-progress", action="store_true", help="no progress bar")
    v.add_argument(
        "--out",
        default=None,
        help="also write the metrics, settings and every sample (id, answer, correctness, length) as JSON here, and "
        "the table beside it (.txt); with --checkpoints: the output directory (default RUN_DIR/eval)",
    )
    v.add_argument("--samples", action="store_true", help="include each sample's prompt and response text in the JSON")
    v.add_argument(
        "--tools",
        default=None,
        metavar="SPEC[,SPEC]",
        help="evaluate multi-turn with these tools (agent.tools: file.py:name or module:name, comma-separated; "
        "replaces the run's agent): agent/turns_mean, agent/tool_success per sample and overall (docs/agents.md)",
    )
    v.add_argument(
        "--environment",
        default=None,
        metavar="SPEC",
        help="evaluate multi-turn with this environment (agent.environment; replaces the run's agent)",
    )
    v.add_argument(
        "--max-turns", type=int, default=None, help="model turns per trajectory (agent.max_turns; default the run's, 4)"
    )
    v.set_defaults(func=cmd_eval)


def cmd_plan(args: argparse.Namespace) -> int:
    from tether.plan import main_plan

    config, overrides = args.config, list(args.overrides)
    if config is not None and "=" in config and not config.endswith((".yaml", ".yml")):
        config, overrides = None, [config, *overrides]
    return main_plan(
        config,
        overrides,
        devices=args.devices,
        device_memory=args.device_memory,
        tp_size=args.tp_size,
        offload=args.offload,
        param_dtype=args.param_dtype,
        gpus_per_node=args.gpus_per_node,
        activation_checkpointing=args.activation_checkpointing,
        rollout_tp=args.rollout_tp,
    )


def _add_plan_parser(sub) -> None:
    pl = sub.add_parser(
        "plan",
        help="per-device memory of every role from the models' config.json (no weights) or a named shape "
        "(actor.model=qwen2.5-32b); fits or not",
    )
    pl.add_argument("config", nargs="?", help="YAML config file")
    pl.add_argument("overrides", nargs="*", help="dotted key=value overrides, as for tether train")
    pl.add_argument("--devices", type=int, default=1, help="devices the roles share (dp × tp; default 1)")
    pl.add_argument("--device-memory", default="80GiB", help="memory of one device, e.g. 80GiB, 141GB (default 80GiB)")
    pl.add_argument(
        "--tp-size",
        type=int,
        default=None,
        help="tensor-parallel size (default actor.tp_size where the config has it, else 1)",
    )
    pl.add_argument(
        "--offload",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="FSDP2 CPU offload of parameters, gradients and optimizer (default trainer.fsdp.cpu_offload)",
    )
    pl.add_argument(
        "--param-dtype",
        choices=["float32", "bfloat16", "float16"],
        default=None,
        help="compute dtype (default trainer.fsdp.param_dtype, else actor.dtype)",
    )
    pl.add_argument(
        "--activation-checkpointing",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="checkpoint actor and critic activations (default actor.gradient_checkpointing for the actor, "
        "trainer.fsdp.activation_checkpointing for both)",
    )
    pl.add_argument(
        "--rollout-tp",
        type=int,
        default=None,
        help="vLLM's tensor-parallel size (default rollout.vllm.tensor_parallel_size when set, else --tp-size)",
    )
    pl.add_argument(
        "--gpus-per-node",
        type=int,
        default=None,
        help="devices per node, for offloaded host memory (default trainer.n_gpus_per_node, else 8)",
    )
    pl.set_defaults(func=cmd_plan)


def cmd_data_solutions(args: argparse.Namespace) -> int:
    from tether.data import DataError, convert_gsm8k_solutions

    try:
        n = convert_gsm8k_solutions(
            Path(args.src), Path(args.out), **({"instruction_suffix": args.suffix} if args.suffix is not None else {})
        )
    except DataError as e:
        print(f"tether data: {e}", file=sys.stderr)
        return 2
    print(f"wrote {n} rows to {args.out}")
    return 0


def cmd_data_benchmark(args: argparse.Namespace) -> int:
    from tether.data import DataError
    from tether.data.benchmarks import CONVERTERS

    kwargs = {k: v for k, v in (("template", args.template), ("data_source", args.data_source)) if v is not None}
    if args.dataset == "gpqa":
        kwargs["seed"] = args.seed
    try:
        n = CONVERTERS[args.dataset](Path(args.src), Path(args.out), **kwargs)
    except DataError as e:
        print(f"tether data: {e}", file=sys.stderr)
        return 2
    print(f"wrote {n} rows to {args.out}")
    return 0


def _add_benchmark_parsers(da_sub) -> None:
    helps = {
        "aime": "AIME (problem, answer) → verl schema",
        "gpqa": "GPQA csv/jsonl/parquet (Question, Correct Answer, "
        "Incorrect Answer 1-3) → verl schema, options shuffled with --seed",
        "math500": "MATH-500 (problem, answer) → verl schema",
    }
    for name, what in helps.items():
        b = da_sub.add_parser(name, help=what)
        b.add_argument("src")
        b.add_argument("out")
        ph = "{question} {A} {B} {C} {D}" if name == "gpqa" else "{problem}"
        b.add_argument(
            "--template",
            default=None,
            help=f"prompt template; {ph} replaced literally (default: tether.data.benchmarks.TEMPLATES[{name!r}], see "
            "docs/eval.md)",
        )
        b.add_argument("--data-source", default=None, help="data_source written in each row (selects the verifier)")
        if name == "gpqa":
            b.add_argument("--seed", type=int, default=0, help="seed of the per-question option shuffle (default 0)")
        b.set_defaults(func=cmd_data_benchmark)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tether", description=USAGE, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command")
    t = sub.add_parser("train", help="train a policy (default: the embedded task)")
    t.add_argument("config", nargs="?", help="YAML config file")
    t.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. kl.coef=0.1")
    t.add_argument("--help-config", action="store_true", help="list every config key with its default and meaning")
    t.set_defaults(func=cmd_train)
    s = sub.add_parser("sft", help="(re)build the embedded task's tiny reference policy")
    s.add_argument(
        "--out",
        default=None,
        help="output directory (default runs/sft-reference; name the shipped reference, "
        "src/tether/tasks/assets/digitsum_ref, to rebuild it, byte-identically with the default seed and steps)",
    )
    s.add_argument("--seed", type=int, default=0, help="seed of the demonstrations and the initialisation (default 0)")
    s.add_argument("--steps", type=int, default=None, help="SFT optimizer steps (default 1500, about 75 s on one core)")
    s.set_defaults(func=cmd_sft)
    r = sub.add_parser("report", help="plots and summary.md of a run directory")
    r.add_argument("run_dir")
    r.set_defaults(func=cmd_report)
    d = sub.add_parser("doctor", help="training health checks of a run directory")
    d.add_argument("run_dir")
    d.set_defaults(func=cmd_doctor)
    vw = sub.add_parser("view", help="a page to read a run's rollout records token by token (trainer.log_rollouts)")
    vw.add_argument("run_dir")
    vw.add_argument("--port", type=int, default=8765, help="port on 127.0.0.1 (default 8765; 0 = any free one)")
    vw.add_argument("--html", default=None, metavar="FILE", help="write one self-contained HTML file instead")
    vw.add_argument("--open", action="store_true", help="open the page in the default browser")
    vw.set_defaults(func=cmd_view)
    e = sub.add_parser("export", help="export a checkpoint as a Hugging Face model directory")
    e.add_argument(
        "checkpoint",
        metavar="CHECKPOINT_OR_RUN",
        help="a checkpoint (runs/<run>/checkpoints/step_N) or a run directory (its latest checkpoint)",
    )
    e.add_argument("out_dir")
    e.set_defaults(func=cmd_export)
    _add_sweep_parser(sub)
    _add_eval_parser(sub)
    _add_plan_parser(sub)
    da = sub.add_parser("data", help="dataset conversion")
    da_sub = da.add_subparsers(dest="dataset")
    g = da_sub.add_parser("gsm8k", help="GSM8K jsonl → verl-schema jsonl/parquet")
    g.add_argument("src")
    g.add_argument("out")
    g.add_argument("--suffix", default=None, help="instruction appended to each question")
    g.set_defaults(func=cmd_data)
    gs = da_sub.add_parser(
        "gsm8k-solutions", help="example_model_solutions.jsonl → offline rows (prompt, response, score)"
    )
    gs.add_argument("src")
    gs.add_argument("out")
    gs.add_argument("--suffix", default=None, help="instruction appended to each question (default none)")
    gs.set_defaults(func=cmd_data_solutions)
    _add_benchmark_parsers(da_sub)
    return p


#: the subcommands that take key=value overrides, and the argument that holds them: overrides may stand anywhere
#: among the flags (argparse takes one run of positionals; the later runs come back unparsed and are added here, in
#: order)
OVERRIDE_ARGS = {"train": "overrides", "sweep": "items", "plan": "overrides"}


def _unknown_command(parser: argparse.ArgumentParser, argv: list[str]) -> str | None:
    """The error line for a first argument that is no subcommand (a did-you-mean from difflib), else None."""
    import difflib

    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))  # noqa: SLF001
    if not argv or argv[0].startswith("-") or argv[0] in sub.choices:
        return None
    close = difflib.get_close_matches(argv[0], list(sub.choices), n=2, cutoff=0.6)
    hint = f"did you mean {' or '.join(close)}? " if close else ""
    return f"unknown command {argv[0]!r}; {hint}commands: {', '.join(sub.choices)} (tether --help)"


def main(argv: list[str] | None = None) -> int:
    _setup_logging()
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    if problem := _unknown_command(parser, argv):
        parser.error(problem)
    args, extra = parser.parse_known_args(argv)
    dest = OVERRIDE_ARGS.get(getattr(args, "command", None))
    if extra and dest is not None and not any(e.startswith("-") for e in extra):
        setattr(args, dest, [*getattr(args, dest), *extra])  # key=value overrides among or after the flags
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if not getattr(args, "func", None):
        parser.print_help()
        return 0 if not argv else 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
