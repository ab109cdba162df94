"""Metric sinks: metrics.jsonl (always), TensorBoard, Weights & Biases and MLflow when installed and asked for."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

log = logging.getLogger("tether")


def _clean(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None if math.isnan(v) else (1e308 if v > 0 else -1e308)
    return v


class MetricsLogger:
    """Writes one JSON line per step to ``run_dir/metrics.jsonl`` and mirrors scalars to the chosen sinks.

    Non-finite floats are written as ``null`` (NaN) so every line stays valid JSON.
    """

    def __init__(self, run_dir: Path, loggers: list[str], *, config: dict, project: str, resume_step: int = 0):
        self.path = Path(run_dir) / "metrics.jsonl"
        self._truncate_after(resume_step)
        self.file = self.path.open("a")
        self.tb = self.wandb = self.mlflow = None
        if "tensorboard" in loggers:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(Path(run_dir) / "events"))
            except ImportError:
                log.warning("trainer.loggers has tensorboard but it is not installed; skipping it")
        if "wandb" in loggers:
            try:
                import wandb

                self.wandb = wandb.init(
                    project=project, config=config, dir=str(run_dir), name=Path(run_dir).name, resume="allow"
                )
            except ImportError:
                log.warning(
                    "trainer.loggers has wandb but it is not installed (pip install 'tether[wandb]'); skipping it"
                )
        if "mlflow" in loggers:
            try:
                import mlflow

                mlflow.set_experiment(project)
                self.mlflow = mlflow.start_run(run_name=Path(run_dir).name)
                mlflow.log_params({k: str(v) for k, v in _flatten(config).items()})
            except ImportError:
                log.warning(
                    "trainer.loggers has mlflow but it is not installed (pip install 'tether[mlflow]'); skipping it"
                )

    def _truncate_after(self, step: int) -> None:
        """On resume, drop lines of steps after the checkpoint so the file has each step once."""
        if not self.path.exists():
            return
        keep = []
        for line in self.path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if rec.get("step", 0) <= step:
                keep.append(line)
        self.path.write_text("".join(x + "\n" for x in keep))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        rec = {"step": step, **{k: _clean(v) for k, v in sorted(metrics.items())}}
        self.file.write(json.dumps(rec) + "\n")
        self.file.flush()
        scalars = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)}
        if self.tb is not None:
            for k, v in scalars.items():
                self.tb.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)
        if self.mlflow is not None:
            import mlflow

            mlflow.log_metrics({k.replace("@", "_at_"): v for k, v in scalars.items()}, step=step)

    def log_samples(self, step: int, rows: list[dict]) -> None:
        """A few recorded responses (``trainer.log_rollouts``; rows of :data:`tether.records.SCHEMA`) as TensorBoard
        text (``rollouts``, a markdown table) and a W&B table (``rollouts``): kind, data source, reward, gold, mean
        KL per token, prompt and response."""
        if not rows or (self.tb is None and self.wandb is None):
            return
        columns = ["kind", "data_source", "reward", "gold", "kl_mean", "prompt", "response"]
        data = []
        for r in rows:
            kl = [x for x in r.get("kl") or [] if x is not None and math.isfinite(x)]
            data.append(
                [
                    r["kind"],
                    r["data_source"],
                    r["reward"],
                    r["gold"],
                    sum(kl) / len(kl) if kl else None,
                    r["prompt"],
                    r["response"],
                ]
            )
        if self.tb is not None:

            def cell(v) -> str:
                text = "–" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)
                return text.replace("|", "\\|").replace("\n", " ")

            lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
            lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in data]
            self.tb.add_text("rollouts", "\n".join(lines), step)
        if self.wandb is not None:
            import wandb

            self.wandb.log({"rollouts": wandb.Table(columns=columns, data=data)}, step=step)

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
        if self.mlflow is not None:
            import mlflow

            mlflow.end_run()


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
