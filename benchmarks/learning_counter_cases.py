"""The CI learning test's counter-cases, run by hand: the test must fail when RL cannot learn.

    python benchmarks/learning_counter_cases.py [--case as-is|sign|lr0|all]

Runs tests/test_learning.py's exact configuration as it is, then with the loss's sign flipped (the trainer
ascends the GRPO loss) and with the learning rate at 0 (the optimizer's own check, lr > 0, is lifted for this
run only).
Prints each held-out reward start -> end and whether the test's assertion (gain >= MARGIN) would pass; writes
benchmarks/results/learning_counter_cases.json. Neither case stays in the suite.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results" / "learning_counter_cases.json"


def run_case(case: str) -> dict[str, Any]:
    import mixfleet.runner.orchestration.onpolicy as onpolicy
    import mixfleet.runner.trainer.trainer as trainer_mod
    from mixfleet.runner.orchestration.pretrain import pretrain

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import test_learning as t

    cfg = onpolicy.OnPolicyConfig(updates=t.UPDATES, eval_every=0, eval_problems=128, eval_samples=2, seed=0)
    original_fn, original_check = trainer_mod.policy_loss_fn, trainer_mod.OptimizerConfig.__post_init__
    try:
        if case == "sign":
            def flipped(config: Any, **kw: Any) -> Any:
                inner = original_fn(config, **kw)
                return trainer_mod.OutputLayerLoss(lambda h, w, b: (lambda lm: (-lm[0], lm[1]))(inner(h, w, b)))

            trainer_mod.policy_loss_fn = flipped
        elif case == "as-is":
            pass
        elif case == "lr0":
            trainer_mod.OptimizerConfig.__post_init__ = lambda self: None      # allow lr = 0 for this run
            object.__setattr__(cfg, "lr", 0.0)
        else:
            raise ValueError(f"--case {case!r}; allowed: as-is, sign, lr0")
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            res = onpolicy.train_on_policy(pretrain().path, cfg, out_dir=Path(tmp))
    finally:
        trainer_mod.policy_loss_fn, trainer_mod.OptimizerConfig.__post_init__ = original_fn, original_check
    start, end = res.evals[0]["reward"], res.evals[-1]["reward"]
    return {"case": case, "heldout_start": start, "heldout_end": end, "gain": end - start, "margin": t.MARGIN,
            "test_passes": end - start >= t.MARGIN, "train_reward": [u["reward"] for u in res.updates],
            "no_tool_call_share": [u["no_tool_call_share"] for u in res.updates],
            "wall_s": time.perf_counter() - t0}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", default="all", choices=("as-is", "sign", "lr0", "all"))
    args = ap.parse_args(argv)
    cases = ("as-is", "sign", "lr0") if args.case == "all" else (args.case,)
    out = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    for case in cases:
        r = run_case(case)
        out[case] = r
        print(f"{case}: held-out reward {r['heldout_start']:.3f} -> {r['heldout_end']:.3f} (gain {r['gain']:+.3f}); "
              f"the test {'passes' if r['test_passes'] else 'fails'} ({r['wall_s']:.0f} s)",
              flush=True)
    RESULTS.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
