"""TOML reading with one clear error naming the file (tomllib on 3.11+, tomli before), and the values kvsim writes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib


def load_toml(path: str | Path) -> dict:
    path = Path(path)
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path}: invalid TOML: {exc}") from None


def toml_value(value: str | bool | int | float) -> str:
    """One value as a TOML literal (a JSON string literal is a valid TOML basic string)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    return str(value) if isinstance(value, int) else repr(float(value))
