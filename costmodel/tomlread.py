"""Typed, validated reading of TOML tables for the cost model's data files.

Every data file (accelerators, precisions, workloads, mismatch priors) is read through these
helpers, so that a bad file always fails the same way: a SpecError naming the file/table, the
field, the value found and what is allowed. No silent defaults for unknown keys: a typo is an error.
"""

from __future__ import annotations

import tomllib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from mixfleet.costmodel.errors import SpecError

_REQUIRED = object()


def read_toml(path: Path) -> dict[str, Any]:
    """Parse a TOML file; a syntax error becomes a SpecError naming the file."""
    if not path.exists():
        raise SpecError(str(path), "<file>", "missing", "an existing TOML file")
    try:
        return tomllib.loads(path.read_text())
    except UnicodeDecodeError:
        raise SpecError(str(path), "<file>", "binary data", "a UTF-8 TOML file") from None
    except tomllib.TOMLDecodeError as e:
        raise SpecError(str(path), "<file>", "not TOML", f"valid TOML ({e})") from None


def check_keys(where: str, table: dict[str, Any], known: Iterable[str]) -> None:
    """Refuse keys that are not known, naming the known ones."""
    known = sorted(set(known))
    for key in table:
        if key not in known:
            raise SpecError(where, key, table[key], "a known field: " + ", ".join(known))


def get_table(where: str, table: dict[str, Any], key: str, default: Any = _REQUIRED) -> dict[str, Any]:
    v = table.get(key, default)
    if v is _REQUIRED:
        raise SpecError(where, key, None, "a table (the field is required)")
    if not isinstance(v, dict):
        raise SpecError(where, key, v, "a table")
    return v


def get_str(where: str, table: dict[str, Any], key: str, default: Any = _REQUIRED,
            allowed: Iterable[str] | None = None) -> str:
    v = table.get(key, default)
    if v is _REQUIRED:
        raise SpecError(where, key, None, "a string (the field is required)")
    if not isinstance(v, str):
        raise SpecError(where, key, v, "a string")
    if allowed is not None:
        allowed = tuple(allowed)
        if v not in allowed:
            raise SpecError(where, key, v, allowed)
    return v


def get_bool(where: str, table: dict[str, Any], key: str, default: Any = _REQUIRED) -> bool:
    v = table.get(key, default)
    if v is _REQUIRED or not isinstance(v, bool):
        raise SpecError(where, key, v, "true or false")
    return v


def get_float(where: str, table: dict[str, Any], key: str, default: Any = _REQUIRED, *,
              lo: float | None = None, hi: float | None = None, lo_open: bool = False) -> float:
    """A number (int or float, never bool) within [lo, hi] (or (lo, hi] with lo_open)."""
    v = table.get(key, default)
    if v is _REQUIRED:
        raise SpecError(where, key, None, f"a number{_range(lo, hi, lo_open)} (the field is required)")
    if isinstance(v, bool) or not isinstance(v, int | float) or v != v:
        raise SpecError(where, key, v, f"a number{_range(lo, hi, lo_open)}")
    if (lo is not None and (v < lo or (lo_open and v == lo))) or (hi is not None and v > hi):
        raise SpecError(where, key, v, f"a number{_range(lo, hi, lo_open)}")
    return float(v)


def get_int(where: str, table: dict[str, Any], key: str, default: Any = _REQUIRED, *,
            lo: int | None = None, hi: int | None = None) -> int:
    v = table.get(key, default)
    if v is _REQUIRED:
        raise SpecError(where, key, None, f"an integer{_range(lo, hi, False)} (the field is required)")
    if isinstance(v, bool) or not isinstance(v, int):
        raise SpecError(where, key, v, f"an integer{_range(lo, hi, False)}")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise SpecError(where, key, v, f"an integer{_range(lo, hi, False)}")
    return v


def get_str_list(where: str, table: dict[str, Any], key: str, default: Any = _REQUIRED,
                 allowed: Iterable[str] | None = None) -> tuple[str, ...]:
    v = table.get(key, default)
    if v is _REQUIRED:
        raise SpecError(where, key, None, "a list of strings (the field is required)")
    if not isinstance(v, list | tuple) or not all(isinstance(x, str) for x in v):
        raise SpecError(where, key, v, "a list of strings")
    if allowed is not None:
        allowed = tuple(allowed)
        for x in v:
            if x not in allowed:
                raise SpecError(where, key, x, allowed)
    return tuple(v)


def _range(lo: float | None, hi: float | None, lo_open: bool) -> str:
    if lo is None and hi is None:
        return ""
    if hi is None:
        return f" > {lo}" if lo_open else f" >= {lo}"
    if lo is None:
        return f" <= {hi}"
    return f" in {'(' if lo_open else '['}{lo}, {hi}]"


def normalize_name(name: str) -> str:
    """Loose key for name look-ups: 'rtx pro 6000' == 'RTX-PRO-6000' == 'rtx_pro_6000'."""
    return "".join(ch for ch in name.lower() if ch.isalnum())
