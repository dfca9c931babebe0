"""Errors the backends raise where the problem is the environment, not the caller's input."""

from __future__ import annotations


class BackendUnavailable(RuntimeError):
    """A backend cannot run here; the message is one line saying why and what would fix it."""


class PreflightFailed(BackendUnavailable):
    """The npu preflight found problems; the message has one line per problem, each with its fix."""
