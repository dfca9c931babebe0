"""Pluggable policies: each class registers its name where it is defined; user classes load by
``module:Class``.

This module imports no policy: the built-ins register when ``kvsim.policies`` is imported (its
``__init__`` imports their modules), so there is no import circle.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T", bound=type)

SCHEDULERS: dict[str, type] = {}
BLOCK_MANAGERS: dict[str, type] = {}


def register_in(table: dict[str, type], kind: str, name: str) -> Callable[[T], T]:
    """A class decorator entering the class in ``table`` under ``name`` (a ``kind`` of plug-in)."""
    def decorate(cls: T) -> T:
        if name in table and table[name] is not cls:
            raise ValueError(f"{kind} {name!r} is already registered by {table[name].__qualname__}")
        table[name] = cls
        cls.registered_name = name
        return cls

    return decorate


def register_scheduler(name: str) -> Callable[[T], T]:
    return register_in(SCHEDULERS, "scheduler", name)


def register_block_manager(name: str) -> Callable[[T], T]:
    return register_in(BLOCK_MANAGERS, "block manager", name)


def resolve_in(table: dict[str, type], kind: str, spec: str) -> type:
    """The class a spec names: a registered name, or ``module:Class``."""
    if ":" in spec:
        module_name, _, attr = spec.partition(":")
        try:
            return getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"cannot load {kind} {spec!r}: {exc}") from None
    if spec not in table:
        raise ValueError(f"unknown {kind} {spec!r}; registered: {', '.join(sorted(table))}; or give module:Class")
    return table[spec]


def resolve_scheduler(spec: str) -> type:
    return resolve_in(SCHEDULERS, "scheduler", spec)


def resolve_block_manager(spec: str) -> type:
    return resolve_in(BLOCK_MANAGERS, "block manager", spec)



def build(table: dict[str, type], kind: str, spec: str, params: dict | None = None):
    """An instance of the class ``spec`` names, with its parameters; a bad parameter names the spec."""
    cls = resolve_in(table, kind, spec)
    try:
        return cls(**(params or {}))
    except TypeError as exc:
        raise ValueError(f"{kind} {spec!r}: {exc}") from None
