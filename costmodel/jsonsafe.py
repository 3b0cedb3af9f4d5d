"""JSON with only finite numbers: `json_safe` turns every NaN / Inf float into null (None).

Python's json writes NaN and Infinity, which are not JSON (browsers, jq and strict parsers refuse them), and
Starlette refuses to render them at all (a 500). Used by every JSON mixfleet emits that may hold a metric
(run summaries, calibration, the sampler server's responses). No imports of ours: part of costmodel/.
"""

from __future__ import annotations

import math
from typing import Any


def json_safe(x: Any) -> Any:
    """Dicts / lists / tuples with every non-finite float replaced by None, so `json.dumps` writes valid JSON."""
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [json_safe(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x
