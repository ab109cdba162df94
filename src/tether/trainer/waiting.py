"""A phase of the loop that runs long says what it waits for: ``step 3: still waiting for the reward (...) (60 s)``.

A reward that never returns, a hung collective or a slow disk otherwise leaves the terminal silent for minutes.
:class:`WaitNotices` wraps each timed phase of :class:`tether.trainer.Trainer` (``PhaseTimer``) and the step-0
validation: a daemon thread per phase logs one line every ``trainer.wait_notice_s`` seconds while the phase runs, and
is stopped when it ends (a phase shorter than the interval costs a thread start and prints nothing).
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager

log = logging.getLogger("tether")


class WaitNotices:
    """``with notices(phase, step):`` logs ``step N: still waiting for <what> (S s)`` every ``interval_s`` seconds
    while the block runs.

    Args:
        interval_s: ``trainer.wait_notice_s``; None = no notices.
        describe: phase name → what it waits for, in words (``what_phases_wait_for``); a phase not in it is named as
            is.
    """

    def __init__(self, interval_s: float | None, describe: dict[str, str] | None = None):
        self.interval_s = interval_s
        self.describe = describe or {}

    @contextmanager
    def __call__(self, phase: str, step: int):
        if not self.interval_s:
            yield
            return
        done, t0 = threading.Event(), time.monotonic()
        what = self.describe.get(phase, phase)

        def watch() -> None:
            while not done.wait(self.interval_s):
                log.info("step %d: still waiting for %s (%.0f s)", step, what, time.monotonic() - t0)

        thread = threading.Thread(target=watch, name=f"tether-wait-{phase}", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()  # no notice after the phase


def what_phases_wait_for(cfg) -> dict[str, str]:
    """The loop's phases (``timing/<phase>_s``) in words, naming the reward each calls and its timeout."""
    r = cfg.reward
    timeout = f"reward.timeout_s={r.timeout_s:g}" if r.timeout_s else "no reward.timeout_s"
    reward = (
        f"reward.function={r.function}"
        if r.function
        else f"reward.model={r.model}"
        if r.model
        else "the built-in reward of each data source"
    )
    gold = (
        f", then the gold reward reward.val_function={r.val_function}"
        if r.val_function
        else f", then the gold reward reward.val_model={r.val_model}"
        if r.val_model
        else ""
    )
    return {
        "rollout": f"the rollout ({cfg.data.batch_size} prompts x rollout.n={cfg.rollout.n} responses)",
        "reward": f"the reward ({reward}; {timeout})",
        "logprobs": "the log-probs of the policy and the reference",
        "teacher": f"the teacher's log-probs (distill.teacher={cfg.distill.teacher})",
        "values": "the critic's values",
        "update_actor": "the actor's update",
        "update_critic": "the critic's update",
        "rollout_join": "the next batch's rollout (rollout.async_steps)",
        "validate": f"validation (generating trainer.val_n={cfg.trainer.val_n} responses per prompt, scored by {reward}"
        f"{gold}; {timeout})",
        "checkpoint": "the checkpoint write",
    }
