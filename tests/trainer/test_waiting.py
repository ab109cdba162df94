"""trainer.wait_notice_s (issue 33): a phase of the loop that runs long says what it waits for, again and again, and
stops saying it when the phase ends. No test here measures time: each waits for the notice it expects."""

import logging
import re
import threading
from pathlib import Path

from tether.trainer import Trainer
from tether.trainer.waiting import WaitNotices


class Notices(logging.Handler):
    """The "still waiting" lines of the tether logger; ``after(n)`` is set once n have come."""

    def __init__(self, n: int, then=None):
        super().__init__(logging.INFO)
        self.lines, self.n, self.then, self.enough = [], n, then, threading.Event()

    def emit(self, record):
        msg = record.getMessage()
        if "still waiting for" in msg:
            self.lines.append(msg)
            if len(self.lines) == self.n:
                if self.then is not None:
                    self.then()
                self.enough.set()


def _listen(handler):
    logger = logging.getLogger("tether")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    return lambda: (logger.removeHandler(handler), logger.setLevel(level))


def _watchers() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("tether-wait-")]


def test_a_phase_says_what_it_waits_for_until_it_ends():
    notices = Notices(3)
    stop = _listen(notices)
    try:
        with WaitNotices(0.01, {"reward": "the reward (reward.function=r.py:f; reward.timeout_s=600)"})("reward", 7):
            assert _watchers() == ["tether-wait-reward"]
            assert notices.enough.wait(60)
        after = list(notices.lines)
        assert _watchers() == []  # stopped and joined with the phase: nothing more is said of it
        with WaitNotices(None)("reward", 8):  # trainer.wait_notice_s=null: no watcher at all
            assert _watchers() == []
    finally:
        stop()
    assert len(after) >= 3 and notices.lines == after
    seconds = []
    for line in after:
        m = re.fullmatch(
            r"step 7: still waiting for the reward \(reward.function=r.py:f; reward.timeout_s=600\) \((\d+) s\)", line
        )
        assert m, line
        seconds.append(int(m.group(1)))
    assert seconds == sorted(seconds)


GOLD_THAT_HANGS = """
import os
import time


def gold(data_sources, solution_strs, ground_truths, extra_infos):
    deadline = time.monotonic() + 120
    while not os.path.exists({flag!r}) and time.monotonic() < deadline:  # hangs until the notice came
        time.sleep(0.01)
    return [0.0] * len(solution_strs)
"""


def test_a_hanging_gold_reward_in_validation_is_not_silent(small_cfg, tmp_path):
    """A gold reward (reward.val_function) that does not return: validation's step-0 phase says what it waits for,
    naming the gold reward and reward.timeout_s."""
    flag = tmp_path / "notice-seen"
    fn = tmp_path / "gold.py"
    fn.write_text(GOLD_THAT_HANGS.format(flag=str(flag)))
    notices = Notices(1, then=lambda: flag.write_text("seen"))
    stop = _listen(notices)
    try:
        t = Trainer(
            small_cfg(
                f"reward.val_function={fn}:gold",
                "trainer.wait_notice_s=0.05",
                "trainer.total_steps=1",
                "trainer.val_freq=1",
                "trainer.report=false",
            )
        )
        t.fit()
    finally:
        stop()
    assert Path(flag).read_text() == "seen"
    assert re.fullmatch(
        rf"step 0: still waiting for validation \(generating trainer.val_n=2 responses per prompt, scored by the "
        rf"built-in reward of each data source, then the gold reward reward.val_function={re.escape(str(fn))}:gold; "
        rf"reward.timeout_s=600\) \(\d+ s\)",
        notices.lines[0],
    ), notices.lines[0]


def test_the_default_interval_is_a_minute_and_null_turns_the_notices_off(small_cfg):
    assert small_cfg().trainer.wait_notice_s == 60.0
    assert small_cfg("trainer.wait_notice_s=null").trainer.wait_notice_s is None
