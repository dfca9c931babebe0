"""Run directories that are either complete or absent: staged under a temporary name, renamed.

A command writes into a hidden sibling ``.NAME.partial-XXXX`` and, once everything is
written, drops the :data:`COMPLETE` marker in it and renames it to ``NAME``. A run that is
killed leaves only the partial directory (never marked complete); an old run being
overwritten stays whole until the new one replaces it, so no old summary ever sits beside
a truncated log.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

COMPLETE = "COMPLETE"


def is_complete(run_dir: Path) -> bool:
    return (Path(run_dir) / COMPLETE).is_file()


def check_out_dir(out: Path, overwrite: bool) -> None:
    """Refuse ``out`` early: a file, a non-empty directory without ``overwrite``, or a parent
    that is not a writable directory."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ValueError(f"--out {out}: directory exists and is not empty; pass --overwrite to replace it")
    parent = out.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"--out {out}: {parent} is a file, not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"--out {out}: {parent} is not writable")


@contextlib.contextmanager
def staged_dir(out: Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a fresh directory to write the run into; on success it becomes ``out``, marked complete."""
    out = Path(out)
    check_out_dir(out, overwrite)
    try:
        out.absolute().parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.absolute().parent))
    except OSError as exc:
        raise ValueError(f"--out {out}: cannot create it: {exc.strerror or exc}") from None
    try:
        yield tmp
        (tmp / COMPLETE).write_text("kvsim: every file of this run was written\n")
        _replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _replace(new: Path, out: Path) -> None:
    if not out.exists():
        new.rename(out)
        return
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    out.rename(old)
    new.rename(out)
    shutil.rmtree(old, ignore_errors=True)
