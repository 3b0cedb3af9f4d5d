"""Episodes drawn from a workload for the twin's sessions: the planner's draw (`planner.shape.draw_episodes`, the
max_context cut included) built as the compiled `twin.core.Episode`, so the planner's screen and the twin see the
same episodes.
"""

from __future__ import annotations

import numpy as np
from mixfleet.costmodel.specs.workload import WorkloadSpec
from mixfleet.planner import shape
from mixfleet.twin.core import Episode

__all__ = ["Episode", "draw_episodes"]  # Episode: compiled (twin/core.py)


def draw_episodes(workload: WorkloadSpec, rng: np.random.Generator, n: int) -> list[Episode]:
    """n episodes (one prompt-group's samples), as the twin's `Episode`s."""
    return shape.draw_episodes(workload, rng, n, episode=Episode)
