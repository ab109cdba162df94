"""The console progress bar: ETA and live reward, KL, β and entropy."""

from __future__ import annotations

import math
import sys


class Progress:
    def __init__(self, total: int, start: int, enabled: bool = True):
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start, desc="tether", unit="step", dynamic_ncols=True, file=sys.stderr)

    def update(self, metrics: dict) -> None:
        if self.bar is None:
            return

        def f(key, fmt):
            v = metrics.get(key)
            return "nan" if v is None or (isinstance(v, float) and not math.isfinite(v)) else format(v, fmt)

        self.bar.set_postfix_str(
            f"reward {f('reward/score_mean', '.3f')}  kl {f('kl/ref_mean', '.4f')}  β {f('kl/coef', '.4f')}  H {f('policy/entropy', '.3f')}"
            + (f"  val {f('val/score_mean', '.3f')}" if "val/score_mean" in metrics else ""),
            refresh=False,
        )
        self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
