"""The console progress: a bar with ETA and live reward, KL, β and entropy, or (``trainer.progress=false``: logs,
schedulers) one plain log line per step with the same numbers and the step's seconds."""

from __future__ import annotations

import logging
import math
import sys

log = logging.getLogger("tether")


def summary(metrics: dict) -> str:
    """``reward 0.531  kl 0.0123  β 0.0500  H 1.234`` (and ``val``): the step's headline numbers, KL in nats/token;
    the reward is ``reward/score_mean`` plus, in an agent run, ``reward/turn_reward_mean``."""

    def f(key, fmt):
        v = metrics.get(key)
        return "nan" if v is None or (isinstance(v, float) and not math.isfinite(v)) else format(v, fmt)

    if "reward/turn_reward_mean" in metrics:  # an agent run: its environment's per-turn rewards count too
        metrics = {
            **metrics,
            "reward/score_mean": metrics.get("reward/score_mean", 0.0) + metrics["reward/turn_reward_mean"],
        }
    return (
        f"reward {f('reward/score_mean', '.3f')}  kl {f('kl/ref_mean', '.4f')}  β {f('kl/coef', '.4f')}  H "
        f"{f('policy/entropy', '.3f')}" + (f"  val {f('val/score_mean', '.3f')}" if "val/score_mean" in metrics else "")
    )


class Progress:
    def __init__(self, total: int, start: int, enabled: bool = True):
        self.bar = None
        self.total, self.done = total, start
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start, desc="tether", unit="step", dynamic_ncols=True, file=sys.stderr)

    def update(self, metrics: dict) -> None:
        self.done += 1
        if self.bar is None:  # no bar: a line per step (a log file shows the run moving)
            log.info(
                "step %d/%d  %s  %.2f s",
                self.done,
                self.total,
                summary(metrics),
                metrics.get("timing/step_s", float("nan")),
            )
            return
        self.bar.set_postfix_str(summary(metrics), refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
