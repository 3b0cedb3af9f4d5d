"""The measured workload: empirical turns, first-prompt and reply tokens; tool tokens by regression.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import numpy as np
import pandas as pd
from mixfleet.costmodel.calibration.lsq import _lsq
from mixfleet.costmodel.specs.workload import WorkloadSpec

EMPIRICAL_MAX_VALUES = 512         # workload distributions keep at most this many values


def _round_values(x: np.ndarray) -> list[float]:
    return [float(v) for v in np.round(x, 6)]


def subsample(x: np.ndarray) -> np.ndarray:
    """`x` sorted, cut to at most EMPIRICAL_MAX_VALUES evenly spaced order statistics (an empirical
    distribution's values; also tool_fit.py's)."""
    x = np.sort(np.asarray(x, dtype=np.float64))
    if len(x) <= EMPIRICAL_MAX_VALUES:
        return x
    return x[np.linspace(0, len(x) - 1, EMPIRICAL_MAX_VALUES).round().astype(int)]


def _measured_workload(trs: list[pd.DataFrame], base: WorkloadSpec, turn_latency_s: float) -> dict[str, Any]:
    """The workload the runs really had: empirical turns, first prompt, reply tokens; tool tokens by regression."""
    tr = pd.concat(trs, ignore_index=True)
    turns = np.maximum(tr["turns"].to_numpy(dtype=np.float64), 1.0)
    ptok = tr["prompt_tokens"].to_numpy(dtype=np.float64)
    gen = tr["generated_tokens"].to_numpy(dtype=np.float64)
    # prompt_tokens = first prompt + (turns - 1) * tool output tokens: least squares with both >= 0
    if np.std(turns) > 0:
        A = np.stack([np.ones_like(turns), turns - 1.0], axis=1)
        x, _, _, _ = _lsq(A, ptok, np.array([1.0, 0.0]), np.array([np.inf, np.inf]),
                          np.array([max(ptok.mean(), 1.0), 0.0]), np.ones_like(ptok))
        tool = float(x[1])
    else:
        tool = 0.0
    first = np.maximum(np.rint(ptok - tool * (turns - 1.0)), 1.0)
    reply = np.maximum(np.rint(gen / turns), 1.0)
    reward = tr["reward"].to_numpy(dtype=np.float64)
    success = float(np.clip(np.nanmean(reward > 0), 0.0, 1.0)) if np.isfinite(reward).any() else base.success_prob
    return {
        "name": f"{base.name}-measured", "description": f"measured from {len(tr)} trajectories",
        "source": "mixfleet calibrate", "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "prompts_per_update": base.prompts_per_update, "samples_per_prompt": base.samples_per_prompt,
        "max_context": base.max_context, "success_prob": success, "no_tool_call_prob": base.no_tool_call_prob,
        "turns": {"kind": "empirical", "values": _round_values(subsample(turns)), "integer": True},
        "prompt_tokens": {"kind": "empirical", "values": _round_values(subsample(first)), "integer": True},
        "reply_tokens": {"kind": "empirical", "values": _round_values(subsample(reply)), "integer": True},
        "tool_output_tokens": {"kind": "const", "value": round(tool, 6)},
        "tool_latency_s": {"kind": "const", "value": round(max(turn_latency_s, 0.0), 9)},
    }
