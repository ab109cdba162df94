"""One run per directory: an exclusive lock on ``<run>/.tether.lock`` for as long as a Trainer lives.

Two ``tether train`` commands on one ``trainer.output_dir`` would write every step twice into
``metrics.jsonl`` and each other's checkpoints. The lock is an OS advisory lock (``fcntl.flock``) on the
file, so it is released by the kernel when its holder exits or is killed: a lock "left behind" by a
SIGKILLed run is free at once, with no staleness heuristic, and the file's text (host, PID, start time)
only serves the message the next command prints. Within one process a second Trainer on the same
directory (a test, a notebook re-running a cell) shares the lock.

POSIX only (``fcntl``); elsewhere the lock is skipped with a warning.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from pathlib import Path

log = logging.getLogger("tether")

LOCK_FILE = ".tether.lock"

#: this process's locks: resolved run directory → [open file, holders]
_HELD: dict[str, list] = {}


class RunDirLocked(ValueError):
    """Another process holds the run directory. The message names it (host, PID, since when)."""


def acquire(run_dir: Path) -> str | None:
    """Lock ``run_dir`` for this process; returns the key to :func:`release` (None where locks are unsupported).

    Raises:
        RunDirLocked: another process holds it, naming its host, PID and start time, and the key to change.
    """
    try:
        import fcntl
    except ImportError:  # not POSIX
        log.warning("run-directory lock unavailable on this platform: nothing stops a second run on %s", run_dir)
        return None
    key = str(Path(run_dir).resolve())
    if key in _HELD:
        _HELD[key][1] += 1
        return key
    path = Path(run_dir) / LOCK_FILE
    f = open(path, "a+")  # noqa: SIM115 (held open for the lock's life)
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        holder = _describe(f.read())
        f.close()
        raise RunDirLocked(
            f"trainer.output_dir={str(run_dir)!r} is in use by another tether train ({holder}): one run per directory. "
            "Wait for it to finish, stop it, or choose another trainer.output_dir"
        ) from None
    f.seek(0)
    f.truncate()
    f.write(
        json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%d %H:%M:%S %Z")})
    )
    f.flush()
    _HELD[key] = [f, 1]
    return key


def release(key: str | None) -> None:
    """Drop one hold of :func:`acquire`'s lock; the last one unlocks the directory."""
    if key is None or key not in _HELD:
        return
    entry = _HELD[key]
    entry[1] -= 1
    if entry[1] <= 0:
        del _HELD[key]
        entry[0].close()  # closing the file releases the flock


def _describe(text: str) -> str:
    try:
        info = json.loads(text)
        return f"host {info['host']}, PID {info['pid']}, since {info['since']}"
    except (ValueError, KeyError, TypeError):
        return "holder unknown"
