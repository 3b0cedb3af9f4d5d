"""The one error type for bad specs, files and configs: it names the field, the value and what is allowed."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


class SpecError(ValueError):
    """A spec, data file or config is invalid. The message names the field and the allowed values."""

    def __init__(self, where: str, field: str, value: Any, allowed: str | Iterable[Any]) -> None:
        if not isinstance(allowed, str):
            allowed = "one of " + ", ".join(repr(a) for a in allowed)
        self.where, self.field, self.value, self.allowed = where, field, value, allowed
        super().__init__(f"{where}: field '{field}' = {value!r} is invalid; allowed: {allowed}")
