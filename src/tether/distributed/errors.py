"""The errors of Ray worker groups and replicas, in one line each (a leaf: every placement module may import it)."""

from __future__ import annotations


class WorkerDiedError(RuntimeError):
    """A Ray worker of a role died or failed; the message names the role's worker group and the rank."""


def death_cause(e: BaseException, limit: int = 300) -> str:
    """What ``ray.get`` said of a dead actor, in one line: the error its ``__init__`` raised (an
    ``ActorDiedError`` of a failed creation task carries the whole remote traceback in its message,
    and Ray's worker logs do not reach the driver), else Ray's account of the death (killed by
    ``ray.kill``, the worker process exited, ...) cut to ``limit`` characters, else the type."""
    msg = str(getattr(e, "error_msg", "") or "")
    lines = [line.strip() for line in msg.splitlines() if line.strip()]
    if getattr(e, "actor_init_failed", False) and lines:
        return f"its __init__ raised {lines[-1]}"  # the remote traceback's last line: 'module.Error: message'
    fields = ("class_name:", "actor_id:", "pid:", "name:", "namespace:", "ip:")
    text = " ".join(
        line for line in lines if not line.startswith(fields) and "died unexpectedly before finishing" not in line
    )
    if not text:
        return type(e).__name__
    return f"{type(e).__name__}: {text[:limit]}{'…' if len(text) > limit else ''}"


def failure_text(cause: BaseException, limit: int = 500) -> str:
    """A worker's error in one line. A ``CheckpointException`` (torch.distributed.checkpoint: a sharded
    save or load that failed on some ranks) is given as each rank's own exception, e.g.
    ``OSError: [Errno 28] No space left on device``, which its text buries at the end of one
    traceback per rank."""
    failures = getattr(cause, "failures", None)
    if isinstance(failures, dict) and failures:
        parts = []
        for rank, f in sorted(failures.items()):
            exc = f[0] if isinstance(f, tuple) else f
            parts.append(f"rank {rank}: {type(exc).__name__}: {exc}")
        return f"{type(cause).__name__} ({'; '.join(parts)})"[:limit]
    return f"{type(cause).__name__}: {cause}"
