"""Output paths: checked before any work starts, written whole or not at all.

Every command that writes to a user-given path (``tether eval --out``, ``tether sweep --out``,
``tether sft --out``, ``tether data ... OUT``, ``tether export OUT_DIR``, ``tether report``'s
``RUN_DIR/report``) asks :func:`output_problem` first, so a path that is a directory where a file is
wanted, a file where a directory is wanted, that lies under a file, or whose directory is on a
read-only file system or not writable, is one clear error instead of a traceback after the work is done.

``tether export``, ``tether report`` and ``tether eval --out`` then write through
:func:`atomic_output`: into a temporary file or directory beside the target (``.<name>.tmp-<pid>``),
renamed into place (``os.replace``) only when complete. A write that fails anyway (a disk that
fills during it, a file system remounted read-only) removes the temporary and raises
:class:`OutputWriteError`, one line naming the path and the OS's reason; the target is left as it was,
so no half-written model or report is ever left looking like a whole one.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Literal


class OutputPathError(ValueError):
    """An output path that cannot be written, found before any work (:func:`output_problem`'s message)."""


class OutputWriteError(OSError):
    """An output could not be written (a full disk, a read-only or vanished directory, no permission).

    ``str()`` is one line naming the path and the OS's reason, e.g. ``cannot write runs/hf: No space left
    on device (no partial output was left)``; ``errno`` is the OS's error number (0 when unknown),
    ``filename`` the path as given. The partial output was removed and the path left as it was.
    """

    def __init__(
        self, code: int, path: str | Path, reason: str | None = None, note: str = "no partial output was left"
    ):
        super().__init__(code, reason or os.strerror(code), str(path))
        self.note = note

    def __str__(self) -> str:
        return f"cannot write {self.filename}: {self.strerror} ({self.note})"


def output_problem(path: str | Path, kind: Literal["file", "dir"], what: str, *, beside: bool = False) -> str | None:
    """Why ``path`` cannot be written as an output ``kind``, or None when it can.

    The directory the output is created in (the nearest existing ancestor; an existing output directory
    itself) must be writable: not on a read-only file system, and writable by this user.

    Args:
        path: the output path (it need not exist; missing parents are created later).
        kind: ``"file"`` (written as one file) or ``"dir"`` (created as a directory).
        what: how the user gave it, for the message (``"--out"``, ``"OUT"``).
        beside: the output is written beside ``path`` and renamed into place (:func:`atomic_output`), so
            the directory holding ``path`` must be writable even when ``path`` is an existing directory.

    Returns:
        A message naming ``what`` and the path, e.g. ``"--out runs/bad is a directory, expected a
        file path"``, or ``"OUT_DIR /mnt/ro/hf cannot be written: /mnt/ro is on a read-only file
        system"``, or None.
    """
    p = Path(path)
    if kind == "file" and p.is_dir():
        return f"{what} {p} is a directory, expected a file path"
    if kind == "dir" and p.exists() and not p.is_dir():
        return f"{what} {p} is a file, expected a directory"
    ancestor = None
    for parent in p.parents:  # the nearest existing ancestor must be a directory
        if parent.exists():
            if not parent.is_dir():
                return f"{what} {p} cannot be created: {parent} is a file, not a directory"
            ancestor = parent
            break
    written_in = ([p] if kind == "dir" and p.is_dir() else []) + (
        [ancestor] if ancestor is not None and (beside or not p.is_dir()) else []
    )
    for d in written_in:
        if why := _not_writable(d):
            return f"{what} {p} cannot be written: {why}"
    return None


def _not_writable(d: Path) -> str | None:
    """Why files cannot be created in the existing directory ``d``, or None."""
    try:
        if os.statvfs(d).f_flag & os.ST_RDONLY:
            return f"{d} is on a read-only file system"
    except (OSError, AttributeError):  # no statvfs (Windows), or a directory that vanished: found by the write
        pass
    ok = os.access(d, os.W_OK | os.X_OK, effective_ids=os.access in os.supports_effective_ids)
    return None if ok else f"{d} is not writable (permission denied)"


def temp_beside(path: str | Path, tag: str = "tmp") -> Path:
    """The temporary sibling an output is written into: ``<dir>/.<name>.<tag>-<pid>``."""
    p = Path(path)
    return p.with_name(f".{p.name}.{tag}-{os.getpid()}")


def io_errno(e: BaseException) -> int | None:
    """The OS error number behind ``e``: its own, one in its ``__cause__``/``__context__`` chain, or one in a
    wrapper's text (safetensors: ``I/O error: No space left on device (os error 28)``; ``[Errno 28]``).
    None when ``e`` is no I/O error."""
    cause, seen = e, set()
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, OSError) and cause.errno:
            return cause.errno
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    if m := re.search(r"\(os error (\d+)\)|\[Errno (\d+)\]", str(e)):
        return int(m.group(1) or m.group(2))
    return None


def check_free_space(path: str | Path, need: int) -> None:
    """Refuse an output of about ``need`` bytes before a byte is written when the file system that will
    hold ``path`` (its nearest existing ancestor) has less free.

    Raises:
        OutputWriteError: ENOSPC, saying how much is needed and how much is free.
    """
    p = Path(os.path.abspath(path))
    existing = next((a for a in (p, *p.parents) if a.exists()), None)
    if existing is None:
        return
    try:
        free = shutil.disk_usage(existing).free
    except OSError:
        return
    if free < need:
        raise OutputWriteError(
            errno.ENOSPC,
            path,
            f"{os.strerror(errno.ENOSPC)}: it needs about {_size(need)}, {_size(free)} free",
            note="nothing was written",
        )


def _size(n: int) -> str:
    unit, div = next(((u, d) for u, d in (("GiB", 2**30), ("MiB", 2**20)) if n >= d), ("KiB", 2**10))
    return f"{n / div:.2f} {unit} ({n} bytes)"


@contextmanager
def atomic_output(path: str | Path, kind: Literal["file", "dir"], *, replace: bool = False) -> Iterator[Path]:
    """Write an output whole or not at all: yields a temporary path beside ``path`` (:func:`temp_beside`;
    for ``kind="dir"`` an empty directory) to write into, renamed onto ``path`` when the block ends
    without error. Missing parent directories are created (and removed again on a failure).

    A file replaces an existing file. A directory replaces a missing or empty one; with ``replace``, also
    a non-empty one (moved aside to ``.<name>.old-<pid>``, the new one renamed in, the old one deleted;
    the old one is moved back if the rename fails). A symbolic link at ``path`` is followed: its target
    is written.

    Raises:
        OutputWriteError: the write failed with an I/O error (full disk, read-only file system, no
            permission, ...; also safetensors' and other wrappers' text naming an ``os error``): the
            temporary was removed, ``path`` is as it was.
        Exception: any other error of the block, re-raised after the temporary was removed.
    """
    given = Path(path)
    target = Path(os.path.realpath(given) if given.is_symlink() else os.path.abspath(given))
    tmp = temp_beside(target)
    created = [a for a in reversed(target.parents) if not a.exists()]  # outermost first
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        _remove(tmp)  # a leftover of an earlier process with this pid
        if kind == "dir":
            tmp.mkdir()
        yield tmp
        if kind == "dir" and replace and target.is_dir() and any(target.iterdir()):
            old = temp_beside(target, "old")
            _remove(old)
            os.replace(target, old)
            try:
                os.replace(tmp, target)
            except BaseException:
                os.replace(old, target)
                raise
            _remove(old)
        else:
            os.replace(tmp, target)
    except BaseException as e:
        _remove(tmp)
        for a in reversed(created):  # the parents this write created, innermost first, if still empty
            try:
                a.rmdir()
            except OSError:
                break
        code = io_errno(e) if isinstance(e, Exception) else None  # Ctrl-C, SystemExit: re-raised as they are
        if isinstance(e, OutputWriteError) or (code is None and not isinstance(e, OSError)):
            raise
        raise OutputWriteError(code or 0, given, os.strerror(code) if code else str(e)) from e


def write_text(path: str | Path, text: str) -> Path:
    """``Path(path).write_text(text)`` through :func:`atomic_output`: the file is whole or unchanged.

    Raises:
        OutputWriteError: see :func:`atomic_output`.
    """
    with atomic_output(path, "file") as tmp:
        tmp.write_text(text)
    return Path(path)


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        try:
            p.unlink()
        except OSError:  # missing, or a file system that no longer lets it go: nothing more to do
            pass
