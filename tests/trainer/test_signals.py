"""tether.signals.StopSignals: the first SIGTERM/SIGINT is a request, the second stops at once."""

import os
import signal

import pytest

from tether.cli import resume_command
from tether.signals import StopSignals, TrainingInterrupted


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_first_signal_requests_a_stop_second_raises_and_handlers_are_restored(sig):
    before = signal.getsignal(sig)
    with StopSignals() as stop:
        assert stop.signum is None
        os.kill(os.getpid(), sig)
        assert stop.signum == sig  # the handler ran; nothing was raised
        with pytest.raises(TrainingInterrupted) as info:
            os.kill(os.getpid(), sig)
    assert info.value.step is None and info.value.exit_code == 128 + sig
    assert isinstance(info.value, KeyboardInterrupt) and not isinstance(info.value, Exception)
    assert signal.getsignal(sig) is before


def test_exit_codes_follow_the_shell_convention():
    assert TrainingInterrupted(signal.SIGTERM, 7).exit_code == 143
    assert TrainingInterrupted(signal.SIGINT, 7).exit_code == 130
    assert str(TrainingInterrupted(signal.SIGTERM, 7)) == "SIGTERM received"


def test_resume_command_keeps_config_and_overrides_and_points_at_the_run():
    cmd = resume_command(
        "configs/gsm8k.yaml",
        ["kl.coef=0.1", "trainer.output_dir=runs/{time}", "data.instruction_suffix= step by step"],
        "runs/20260101-000000",
    )
    assert cmd == (
        "tether train configs/gsm8k.yaml kl.coef=0.1 'data.instruction_suffix= step by step' "
        "trainer.output_dir=runs/20260101-000000"
    )
    assert resume_command(None, [], "runs/x") == "tether train trainer.output_dir=runs/x"


def test_a_worker_that_dies_after_the_signal_abandons_the_step_like_a_second_signal():
    """A SIGTERM to the whole process group may stop the Ray workers mid-step: their error then becomes the signal's
    stop (exit 128 + signum, the last complete checkpoint), not the worker's; before any signal it stays an error, and
    so does an error of tether's own code after one."""
    import signal as _signal
    from types import SimpleNamespace

    from tether.distributed.ray_backend import WorkerDiedError
    from tether.trainer import Trainer, TrainingInterrupted

    t = object.__new__(Trainer)

    def boom():
        raise WorkerDiedError("actor+ref worker group: rank 0 died during compute_logprobs")

    t.train_step = boom
    t._signals = SimpleNamespace(signum=None)
    with pytest.raises(WorkerDiedError):
        t.train_step_or_abandon()
    t._signals.signum = _signal.SIGTERM
    with pytest.raises(TrainingInterrupted) as e:
        t.train_step_or_abandon()
    assert e.value.exit_code == 143 and e.value.step is None

    def bug():
        raise ValueError("a bug of our own")

    t.train_step = bug
    with pytest.raises(ValueError):
        t.train_step_or_abandon()
