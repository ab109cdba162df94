"""SIGTERM and SIGINT during training: finish the step, write a checkpoint, stop with a resume hint.

Schedulers (SLURM, Kubernetes), ``timeout`` and preemption send SIGTERM and wait a grace period
(commonly 30 s) before SIGKILL; Ctrl-C sends SIGINT. While :meth:`Trainer.fit` runs,
:class:`StopSignals` turns the **first** of either signal into a request: the step in progress
finishes (so the checkpoint holds a whole step, exactly what a scheduled checkpoint would hold, and
resuming from it continues as an uninterrupted run would), a checkpoint of that step is written,
and :class:`TrainingInterrupted` is raised. A **second** signal abandons the step at once (raising
:class:`TrainingInterrupted` from wherever the code is; checkpoints are written atomically, so a
half-written one is never mistaken for a whole one) and the latest complete checkpoint stays the
resume point. So does a step that has not finished ``grace_s`` seconds (``trainer.stop_grace_s``) after
the first signal (a reward function that never returns, a hung collective): the grace timer sends the
signal again, so a scheduler or ``timeout`` that sends one SIGTERM always gets its job back. ``tether train`` then
prints how to resume and exits with 128 + the signal number
(130 for SIGINT, 143 for SIGTERM), the shell's convention for a process ended by a signal.

Handlers are installed only on the main thread (Python allows no other) and the previous handlers
are restored when ``fit`` returns.
"""

from __future__ import annotations

import logging
import os
import signal
import threading

log = logging.getLogger("tether")

SIGNALS = tuple(s for s in (getattr(signal, "SIGTERM", None), signal.SIGINT) if s is not None)


class TrainingInterrupted(KeyboardInterrupt):
    """Training stopped on a signal.

    A ``KeyboardInterrupt`` (a ``BaseException``), so that no ``except Exception`` around user code
    (a reward function, a data loader) swallows it.

    Attributes:
        signum: the signal (``signal.SIGTERM``, ``signal.SIGINT``).
        step: the last step whose checkpoint was written on the way out, or None when the step was
            abandoned (second signal) and the resume point is an earlier checkpoint.
    """

    def __init__(self, signum: int, step: int | None = None):
        self.signum, self.step = signum, step
        super().__init__(f"{signal_name(signum)} received")

    @property
    def exit_code(self) -> int:
        """128 + the signal number (130 for SIGINT, 143 for SIGTERM)."""
        return 128 + int(self.signum)


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class StopSignals:
    """Context manager: while active, the first SIGTERM/SIGINT sets :attr:`signum` (checked by the
    training loop between steps) and a second raises :class:`TrainingInterrupted` at once."""

    def __init__(self, grace_s: float | None = None):
        self.signum: int | None = None
        self.grace_s = grace_s  # trainer.stop_grace_s: None = wait for the step however long it takes
        self.grace_expired = False
        self._previous: dict[int, object] = {}
        self._timer: threading.Timer | None = None

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:
            if self.grace_expired:
                log.warning(
                    "the step did not finish within trainer.stop_grace_s=%g s of the %s: abandoning it without a new "
                    "checkpoint",
                    self.grace_s,
                    signal_name(signum),
                )
            else:
                log.warning("%s again: abandoning the step in progress without a new checkpoint", signal_name(signum))
            raise TrainingInterrupted(signum)
        self.signum = signum
        log.warning(
            "%s received: finishing the step in progress, then writing a checkpoint and stopping (send it again to "
            "stop at once%s)",
            signal_name(signum),
            f"; after trainer.stop_grace_s={self.grace_s:g} s the step is abandoned" if self.grace_s else "",
        )
        if self.grace_s:
            self._timer = threading.Timer(self.grace_s, self._expire, args=(signum,))
            self._timer.daemon = True
            self._timer.start()

    def _expire(self, signum: int) -> None:
        """The grace period ran out with the step still going: the signal again (handled on the main thread)."""
        self.grace_expired = True
        os.kill(os.getpid(), signum)

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}
