"""Run directories that are either complete or absent: staged under a temporary name, renamed.

A command writes into a hidden sibling ``.NAME.partial-XXXX`` and, once everything is
written, drops the :data:`COMPLETE` marker in it and renames it to ``NAME``. A run that is
killed leaves only the partial directory (never marked complete); an old run being
overwritten stays whole until the new one replaces it, so no old summary ever sits beside
a truncated log.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
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


@dataclass
class StagedDir:
    """A fresh hidden directory to write a run into; leaving the ``with`` block without an
    error marks it complete and renames it to ``out``, with an error removes it."""

    out: Path
    tmp: Path

    def __enter__(self) -> Path:
        return self.tmp

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return False
        try:
            (self.tmp / COMPLETE).write_text("kvsim: every file of this run was written\n")
            _replace(self.tmp, self.out)
        except BaseException:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise
        return False


def staged_dir(out: Path, overwrite: bool = False) -> StagedDir:
    """Check ``out`` and create its staging directory now (a ValueError names what is wrong),
    so that callers can report that apart from failures of the run itself."""
    out = Path(out)
    check_out_dir(out, overwrite)
    try:
        out.absolute().parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.absolute().parent))
    except OSError as exc:
        raise ValueError(f"--out {out}: cannot create it: {exc.strerror or exc}") from None
    return StagedDir(out, tmp)


def _replace(new: Path, out: Path) -> None:
    if not out.exists():
        new.rename(out)
        return
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    out.rename(old)
    new.rename(out)
    shutil.rmtree(old, ignore_errors=True)
