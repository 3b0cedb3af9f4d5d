"""The repo task's base policy: how often it fixes a generated repository, on the training and the held-out split.

Pretrains (or finds in the cache) the base policy `mixfleet pretrain --task repo --steps STEPS` makes, then samples
EPISODES episodes of each split at T = 1 with the embedded engine (bf16, the repo reply cap of 128 tokens), every
command in a real sandbox, and writes benchmarks/results/repo_base.json: per split the success rate with its 95 %
Wilson interval, the finish reasons, and what the policy did (a look, a test run, an edit, a submission) per
episode; success per bug kind on the held-out split. Nothing here is timed.

    python benchmarks/repo_base.py [--steps 1400] [--episodes 64] [--out benchmarks/results/repo_base.json]
    python benchmarks/repo_base.py --steps 1000 --lr-decay --init-from d8fd6581990e30ff38e8cc93 \
        --out benchmarks/results/repo_base_2400.json      # 1000 more steps of the 1400-step base, lr cosine to 0
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections import Counter
from pathlib import Path

from mixfleet.runner.orchestration.pretrain import PretrainConfig, base_folder, pretrain, sample_episodes
from mixfleet.runner.rollout.agent import Episode
from mixfleet.runner.rollout.demos import DemoConfig
from mixfleet.runner.rollout.tasks.repo import generate

ROOT = Path(__file__).resolve().parents[1]


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95 % Wilson score interval of a success rate k / n."""
    if n == 0:
        return (math.nan, math.nan)
    p = k / n
    mid = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, mid - half), min(1.0, mid + half))


def window_means(xs: list[float], width: int = 200) -> list[float]:
    """Means of consecutive windows of `width` values (the last one may be shorter)."""
    return [sum(xs[i:i + width]) / len(xs[i:i + width]) for i in range(0, len(xs), width)]


def actions(ep: Episode) -> dict[str, bool]:
    """What an episode's replies did (its tool calls as the agent loop parsed them): looked at lib.py, ran the
    tests, edited lib.py, submitted."""
    calls = [t.call for t in ep.turns if t.call is not None]
    bash = [c.args for c in calls if c.name == "bash"]
    return {"looked": any(("cat lib.py" in a or "grep" in a) for a in bash),
            "tested": any("unittest" in a for a in bash),
            "edited": any(("sed -i" in a or "open('lib.py','w')" in a) for a in bash),
            "submitted": any(c.name == "submit" for c in calls)}


def split_report(checkpoint: Path, split: str, episodes: int) -> dict:
    t0 = time.perf_counter()
    eps = sample_episodes(checkpoint, task="repo", episodes=episodes, split=split)
    rows = []
    for e in eps:
        p = generate(e.seed)
        rows.append({"seed": e.seed, "template": p.template, "kind": p.kind, "site": p.site, "reward": e.reward,
                     "finish": e.finish_reason, "turns": e.num_turns,
                     **actions(e)})
    k = sum(r["reward"] == 1.0 for r in rows)
    kinds: dict[str, list[int]] = {}
    for r in rows:
        kinds.setdefault(r["kind"], [0, 0])
        kinds[r["kind"]][0] += r["reward"] == 1.0
        kinds[r["kind"]][1] += 1
    n = len(rows)
    return {"split": split, "episodes": n, "solved": k, "success": k / n, "success_95": wilson(k, n),
            "finish_reasons": dict(Counter(r["finish"] for r in rows)),
            "share": {a: sum(r[a] for r in rows) / n for a in ("looked", "tested", "edited", "submitted")},
            "by_kind": {kind: {"solved": s, "episodes": m} for kind, (s, m) in sorted(kinds.items())},
            "wall_s": time.perf_counter() - t0, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=1400, help="pretraining steps of the base (default 1400)")
    ap.add_argument("--episodes", type=int, default=64, help="episodes per split (default 64)")
    ap.add_argument("--lr-decay", action="store_true", help="the base's lr a cosine to 0 (pretrain --lr-decay)")
    ap.add_argument("--init-from", default=None, help="cache key of the base the pretraining goes on from "
                    "(pretrain --init-from)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "repo_base.json"))
    args = ap.parse_args()
    init = base_folder(args.init_from) if args.init_from else None
    res = pretrain(PretrainConfig(demos=DemoConfig(task="repo"), steps=args.steps, lr_decay=args.lr_decay,
                                  init_from=init))
    meta = res.meta
    base = {"key": res.key, "steps": args.steps, "lr_decay": args.lr_decay, "init_from": args.init_from,
            "final_loss": meta["losses"][-1],
            "final_token_accuracy": meta["token_accuracy"][-1], "epochs": meta["epochs"],
            "demos_s": meta["demos_s"], "train_s": meta["train_s"], "demo_reward": meta["demo_stats"]["reward"],
            # the per-step figures are noisy (rows of different episodes): their means over 200-step windows
            "loss_per_200_steps": window_means(meta["losses"]),
            "token_accuracy_per_200_steps": window_means(meta["token_accuracy"])}
    print(f"base {res.key} ({'cached' if res.reused else 'trained now'}): final SFT loss {base['final_loss']:.3f}, "
          f"token accuracy {base['final_token_accuracy']:.3f}, demonstration reward {base['demo_reward']:.3f}")
    more = (" --lr-decay" if args.lr_decay else "") + (f" --init-from {args.init_from}" if args.init_from else "")
    out = {"command": f"python benchmarks/repo_base.py --steps {args.steps}{more} --episodes {args.episodes}",
           "base": base,
           "temperature": 1.0, "precision": "bf16", "splits": {}}
    for split in ("train", "eval"):
        rep = split_report(res.path, split, args.episodes)
        lo, hi = rep["success_95"]
        share = ", ".join(f"{a} {v:.2f}" for a, v in rep["share"].items())
        print(f"{split:5s}: {rep['solved']}/{rep['episodes']} solved ({rep['success']:.3f}, 95 % [{lo:.3f}, "
              f"{hi:.3f}]); {share}; finish {rep['finish_reasons']}")
        if split == "eval":
            kinds = rep["by_kind"].items()
            print("       by kind: " + ", ".join(f"{k} {v['solved']}/{v['episodes']}" for k, v in kinds))
        out["splits"][split] = rep
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
