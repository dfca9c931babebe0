"""The CLI's error boundary: a user's mistake is one line and exit 2, a bug is exit 1 and a hint.

Commands turn what a user can get wrong (paths, names, values, trace contents) into
:class:`UserError` where they read it; :func:`user_errors` does that for the exceptions
loaders and validators raise. Anything else that escapes a command is a bug in kvsim or in a
plugin: the root group (``kvsim.cli.main``) prints it short and says how to see the traceback.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import click

USER_ERROR_EXIT = 2
BUG_EXIT = 1


class UserError(click.ClickException):
    """A mistake in the user's input: printed as ``Error: <message>``, exit status 2."""

    exit_code = USER_ERROR_EXIT


def describe_os_error(exc: OSError) -> str:
    """``path: reason`` for a file-system error (no errno noise)."""
    reason = exc.strerror or str(exc)
    return f"{exc.filename}: {reason.lower()}" if exc.filename else reason


@contextlib.contextmanager
def user_errors(context: str = "") -> Iterator[None]:
    """Report ValueError/KeyError/OSError raised while reading user input as one-line UserErrors.

    Use it only around code whose failures are about the input (loading, validating,
    resolving names); ``context`` (e.g. ``"--config run.toml"``) prefixes the message.
    """
    prefix = f"{context}: " if context else ""
    try:
        yield
    except click.ClickException:
        raise
    except KeyError as exc:
        raise UserError(prefix + _one_line(str(exc.args[0] if exc.args else exc))) from None
    except ValueError as exc:  # TraceFormatError is a ValueError
        raise UserError(prefix + _one_line(str(exc))) from None
    except OSError as exc:
        raise UserError(prefix + describe_os_error(exc)) from None


def _one_line(text: str) -> str:
    return " ".join(text.split())


def debug_enabled() -> bool:
    return os.environ.get("KVSIM_DEBUG", "") not in ("", "0")


def bug_message(exc: BaseException) -> str:
    """Short report of an unexpected exception (a bug), with how to get the traceback."""
    return (
        f"internal error: {type(exc).__name__}: {_one_line(str(exc))[:300]}\n"
        "This is a bug in kvsim or in a plugin; rerun with --debug (or KVSIM_DEBUG=1) for the traceback and report it."
    )
