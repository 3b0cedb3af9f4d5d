"""RL that learns: a short seeded on-policy GRPO run raises the held-out reward of the base policy.

The plainest loop there is (runner/orchestration/onpolicy.py: the embedded engine in the trainer's fp32 numbers,
the agent loop, `build_batch`, the Megatron-core trainer and the corrections loss, no Ray) on the `guess` task
from the cached `mixfleet pretrain` base policy, with the learning recipe of docs/learning.md (8 prompts x 8
samples, std-normalized GRPO advantages, every trajectory weighed the same, AdamW 3e-4 after a 3-update warm-up).

Held-out reward: 128 problems of the eval split x 2 episodes at T = 1 over the full vocabulary (bf16 engine),
the same episodes' seeds before and after, so an unchanged policy scores exactly the same. Measured on this
project's 2-core machines (docs/learning.md): 0.344 -> 0.508 and 0.340 -> 0.387 after 10 updates (seed 0, two
CPUs). The test asks for a rise
of at least MARGIN after UPDATES updates; it fails with the loss's sign flipped (the reward falls) and with the
learning rate near 0 (no change), both run by hand and recorded in docs/learning.md.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from mixfleet.runner.orchestration.onpolicy import OnPolicyConfig, train_on_policy
from mixfleet.runner.orchestration.pretrain import pretrain

UPDATES = 10
MARGIN = 0.03          # held-out reward gain asked for. Measured: +0.164 on the machine of 2026-12-01, +0.047 on
                       # another 2-core CPU of 2026-12-02 (the same base, bitwise, reads 0.340 there vs 0.344: CPU
                       # numerics change the sampled episodes, so one seed's 10 updates land differently). lr 0 gives
                       # exactly +0.000 (the same episodes' seeds) and the flipped sign -0.344: both still fail.

pytestmark = pytest.mark.slow


def test_on_policy_grpo_raises_the_held_out_reward(tmp_path: Path) -> None:
    base = pretrain().path
    cfg = OnPolicyConfig(updates=UPDATES, eval_every=0, eval_problems=128, eval_samples=2, seed=0)
    res = train_on_policy(base, cfg, out_dir=tmp_path / "onpolicy")
    start, end = res.evals[0], res.evals[-1]
    assert (start["version"], end["version"]) == (0, UPDATES)
    assert start["episodes"] == end["episodes"] == 256
    gain = end["reward"] - start["reward"]
    assert gain >= MARGIN, f"held-out reward {start['reward']:.3f} -> {end['reward']:.3f} (gain {gain:+.3f})"
    assert max(u["k3"] for u in res.updates) < 1e-9                    # exactly on-policy, every update
    assert max(u["no_tool_call_share"] for u in res.updates[-3:]) < 0.2   # not learning to stop calling tools
    assert not any((tmp_path / "onpolicy").iterdir())                  # exports removed
