"""The CI learning guard's false-pass and false-fail rates, measured over seeds (resumable).

    nice -n 10 python benchmarks/learning_guard_rates.py [--seeds K] [--first-seed S] [--faults none,sign,...] [--fresh]

For each seed S..S+K-1 (S = 0 by default; --first-seed 20 measures seeds the threshold was not chosen on): one
batch sampled as tests/test_learning_guard.py samples it (its `sample_batch` with that seed: other problems, other
sampling seeds, another weight-noise draw), then the guard's two checks (`run_guard`) once with the correct loss
and once per counter-case, all on that batch. A seed's records are written to
benchmarks/results/learning_guard_rates.json as soon as they exist; a second call skips (seed, fault) pairs
already there, so an interrupted run goes on where it stopped.

false-fail rate = share of seeds where the correct loss ("none") fails the guard;
false-pass rate (per counter-case) = share of seeds where that fault passes it. With 0 events in K seeds the
one-sided 95% upper bound is 1 - 0.05^(1/K) (about 3/K), reported as `upper95`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "learning_guard_rates.json"


def upper95(events: int, n: int) -> float:
    """One-sided 95% Clopper-Pearson upper bound on a rate with `events` in `n` (bisection on the binomial cdf)."""
    from math import comb

    if n == 0:
        return 1.0
    if events >= n:
        return 1.0
    lo, hi = events / n, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        cdf = sum(comb(n, k) * mid**k * (1 - mid) ** (n - k) for k in range(events + 1))
        lo, hi = (mid, hi) if cdf > 0.05 else (lo, mid)
    return hi


def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _span(rs: list[dict[str, Any]], m: str) -> tuple[float | None, float | None]:
    """min and max of measure `m` over the records that measured it (the direction is not measured once the
    reference check has failed: `run_guard` stops there)."""
    xs = [r[m] for r in rs if r[m] is not None]
    return (min(xs), max(xs)) if xs else (None, None)


def summarize(records: list[dict[str, Any]], faults: tuple[str, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in faults:
        rs = [r for r in records if r["fault"] == f]
        if not rs:
            continue
        wrong = sum(r["passes"] for r in rs) if f != "none" else sum(not r["passes"] for r in rs)
        out[f] = {"seeds": len(rs), "passes": sum(r["passes"] for r in rs),
                  ("false_fail" if f == "none" else "false_pass"): wrong,
                  "rate": wrong / len(rs), "upper95": upper95(wrong, len(rs)),
                  **{f"{m}_{end}": v for m in ("ref_err", "corr", "mean_abs_delta")
                     for end, v in zip(("min", "max"), _span(rs, m), strict=True)},
                  "failed_checks": sorted({c for r in rs for c in r["failed_checks"]})}
    return out


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(ROOT / "tests"))
    import test_learning_guard as g
    import torch
    from mixfleet.runner.orchestration.pretrain import pretrain

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=20, help="K seeds, S..S+K-1 (default 20)")
    ap.add_argument("--first-seed", type=int, default=0, help="S, the first seed (default 0)")
    ap.add_argument("--faults", default=",".join(g.FAULTS), help=f"comma-separated, of {', '.join(g.FAULTS)}")
    ap.add_argument("--fresh", action="store_true", help="drop the results file's records first")
    args = ap.parse_args(argv)
    faults = tuple(f for f in args.faults.split(",") if f)
    bad = [f for f in faults if f not in g.FAULTS]
    if bad or args.seeds < 1 or args.first_seed < 0:
        ap.error(f"--faults {bad} / --seeds {args.seeds} / --first-seed {args.first_seed}; allowed: faults of "
                 f"{', '.join(g.FAULTS)}, seeds >= 1, first seed >= 0")
    torch.set_num_threads(2)
    data = json.loads(RESULTS.read_text()) if RESULTS.exists() and not args.fresh else {}
    settings = {"prompts": g.PROMPTS, "samples": g.SAMPLES, "top_p": g.TOP_P, "sampler": g.SAMPLER, "lr": g.LR,
                "steps": g.STEPS, "ref_tol": g.REF_TOL, "corr_min": g.CORR_MIN, "delta_min": g.DELTA_MIN}
    if data.get("settings") not in (None, settings):
        raise SystemExit(f"{RESULTS}: measured with other settings {data['settings']}; rerun with --fresh")
    records: list[dict[str, Any]] = data.get("records", [])
    done = {(r["seed"], r["fault"]) for r in records}
    base = str(pretrain().path)
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        todo = [f for f in faults if (seed, f) not in done]
        if not todo:
            continue
        t0 = time.perf_counter()
        sampled = g.sample_batch(base, seed)
        for f in todo:
            r = g.run_guard(base, sampled, f, seed=seed)
            r["wall_s"] = time.perf_counter() - t0
            records.append(r)
            print(f"seed {seed} {f:12s} {'PASS' if r['passes'] else 'fail'}  ref_err {r['ref_err']:.2e}  "
                  f"corr {fmt(r['corr'], '+.3f')}  |dlogp| {fmt(r['mean_abs_delta'], '.3g')}", flush=True)
            t0 = time.perf_counter()
            RESULTS.parent.mkdir(parents=True, exist_ok=True)
            RESULTS.write_text(json.dumps({"settings": settings, "summary": summarize(records, g.FAULTS),
                                           "records": records}, indent=1) + "\n")
    summary = summarize(records, g.FAULTS)
    for f, s in summary.items():
        kind = "false-fail" if f == "none" else "false-pass"
        print(f"{f:12s} {kind} {s['rate']:.3f} ({s.get('false_fail', s.get('false_pass'))}/{s['seeds']}, 95% upper "
              f"{s['upper95']:.3f})  corr {fmt(s['corr_min'], '+.2f')}..{fmt(s['corr_max'], '+.2f')}  ref_err "
              f"{s['ref_err_min']:.1e}..{s['ref_err_max']:.1e}  failed checks: {', '.join(s['failed_checks']) or '-'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
