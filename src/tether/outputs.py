"""Checks that an output path can be written, made before any work starts.

Every command that writes to a user-given path (``tether eval --out``, ``tether sweep --out``,
``tether sft --out``, ``tether data ... OUT``) asks :func:`output_problem` first, so a path that is
a directory where a file is wanted, a file where a directory is wanted, or that lies under a file,
is one clear error instead of a traceback after the work is done.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal


def output_problem(path: str | Path, kind: Literal["file", "dir"], what: str) -> str | None:
    """Why ``path`` cannot be written as an output ``kind``, or None when it can.

    Args:
        path: the output path (it need not exist; missing parents are created later).
        kind: ``"file"`` (written as one file) or ``"dir"`` (created as a directory).
        what: how the user gave it, for the message (``"--out"``, ``"OUT"``).

    Returns:
        A message naming ``what`` and the path, e.g. ``"--out runs/bad is a directory, expected a
        file path"``, or None.
    """
    p = Path(path)
    if kind == "file" and p.is_dir():
        return f"{what} {p} is a directory, expected a file path"
    if kind == "dir" and p.exists() and not p.is_dir():
        return f"{what} {p} is a file, expected a directory"
    for parent in p.parents:  # the nearest existing ancestor must be a directory
        if parent.exists():
            if not parent.is_dir():
                return f"{what} {p} cannot be created: {parent} is a file, not a directory"
            break
    return None
