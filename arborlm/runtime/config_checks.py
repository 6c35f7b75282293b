"""The checks every config dataclass's `__post_init__` runs (`runtime/config.py` and its parts).

Torch-free, like the configs: the HTTP process validates its arguments with them.
"""

from __future__ import annotations

import typing
from dataclasses import fields
from typing import Any


def check_field(cond: bool, name: str, value: Any, expected: str) -> None:
    """Raise ValueError naming the field ``name`` and its ``value`` unless ``cond``."""
    if not cond:
        raise ValueError(f"{name}={value!r} is invalid: expected {expected}")


def check_types(config: Any) -> None:
    """Raise TypeError for a field whose value does not match its annotation
    (int, float, str, bool, a tuple of str, or None)."""
    hints = typing.get_type_hints(type(config))
    for f in fields(config):
        value = getattr(config, f.name)
        allowed = typing.get_args(hints[f.name]) or (hints[f.name],)
        if value is None and type(None) in allowed:
            continue
        ok = any(
            (t is float and isinstance(value, (int, float)) and not isinstance(value, bool))
            or (t is int and isinstance(value, int) and not isinstance(value, bool))
            or (t in (str, bool) and isinstance(value, t))
            or (typing.get_origin(t) is tuple and isinstance(value, tuple) and all(isinstance(v, str) for v in value))
            for t in allowed
        )
        if not ok:
            names = " or ".join("None" if t is type(None) else str(t) if typing.get_origin(t) else t.__name__
                                for t in allowed)
            raise TypeError(f"{f.name}={value!r} has the wrong type: expected {names}")
