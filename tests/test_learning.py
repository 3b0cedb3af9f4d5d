"""The in-process on-policy loop runs as one piece: the sampler serves each version the trainer exported.

runner/orchestration/onpolicy.py (embedded engine in the trainer's fp32 numbers, agent loop, `build_batch`,
the Megatron-core trainer, the corrections loss, held-out evaluation) for 2 updates from the cached base policy
(`pretrain()`, shared with tests/test_learning_guard.py). Update 1 samples from the base, update 2 from the
version the trainer exported and the engine loaded from disk: the loss's sampler-trainer k3 is ~1e-13 on both
only if that hand-over worked (an engine still holding the base after one AdamW step reads k3 >> 1e-9).

Whether the loss LEARNS is tests/test_learning_guard.py's question (a direction check on one batch, with
counter-cases and measured false-pass / false-fail rates: docs/learning.md, "The CI learning test"). This file
asked it before with a 10-update held-out gain >= 0.03 on one seed, a bar at the noise floor (160-190 s).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from mixfleet.runner.orchestration.onpolicy import OnPolicyConfig, train_on_policy
from mixfleet.runner.orchestration.pretrain import pretrain

UPDATES = 2

pytestmark = pytest.mark.slow


def test_on_policy_loop_serves_each_exported_version(tmp_path: Path) -> None:
    base = pretrain().path
    cfg = OnPolicyConfig(updates=UPDATES, prompts_per_update=4, eval_every=0, eval_problems=8, eval_samples=1,
                         seed=0)
    res = train_on_policy(base, cfg, out_dir=tmp_path / "onpolicy")
    assert [e["version"] for e in res.evals] == [0, UPDATES]
    assert all(e["episodes"] == 8 for e in res.evals)
    assert [u["version"] for u in res.updates] == list(range(1, UPDATES + 1))
    assert all(u["grad_norm"] > 0 and u["lr"] > 0 for u in res.updates)
    assert max(u["k3"] for u in res.updates) < 1e-9, [u["k3"] for u in res.updates]   # exactly on-policy
    assert not any((tmp_path / "onpolicy").iterdir())                  # exports removed
