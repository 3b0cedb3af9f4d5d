"""The same results before and after a refactor: the dry run of every shipped plan and `mixfleet plan`, compared
bit for bit between this tree and another commit (issue 43: "the dry runs of every shipped plan and `mixfleet plan`
bit for bit the same before and after the moves, same seeds").

For each plan in data/plans/: `mixfleet simulate PLAN -n UPDATES --seed SEED --json` in both; then
`mixfleet plan --json --verify V` (and the defaults) in both, each on a fresh check cache. Every value present in
both outputs must be equal (floats bit for bit, through JSON's round trip); wall times and folders are left out;
keys only one side has (figures added since) are listed, not compared; a plan the other commit cannot read (a
table added since) is listed as "new here". Prints a table and writes
benchmarks/results/same_results.json.

    python benchmarks/same_results.py --beside c6775cc^ [--updates 4] [--seed 0] [--plan-verify 3] \
        [--changed CASE=WHY ...]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from beside import ROOT, build, head

OUT = Path(__file__).resolve().parent / "results" / "same_results.json"
NOT_COMPARED = {"wall_s", "events_per_s", "runlog_dir", "plan_file", "checks", "run_id"}   # machine time, folders, ids


def flat(x: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(x, dict):
        out: dict[str, Any] = {}
        for k, v in x.items():
            if k not in NOT_COMPARED:
                out.update(flat(v, f"{prefix}{k}."))
        return out
    if isinstance(x, list):
        out = {}
        for i, v in enumerate(x):
            out.update(flat(v, f"{prefix}{i}."))
        return out
    return {prefix.rstrip("."): x}


def compare(a: Any, b: Any) -> dict[str, Any]:
    fa, fb = flat(a), flat(b)
    common = sorted(set(fa) & set(fb))
    differ = [k for k in common if fa[k] != fb[k] and not (fa[k] != fa[k] and fb[k] != fb[k])]   # NaN == NaN
    return {"compared": len(common), "differ": [{"key": k, "this": fa[k], "other": fb[k]} for k in differ[:20]],
            "n_differ": len(differ), "only_this": sorted(set(fa) - set(fb))[:20],
            "only_other": sorted(set(fb) - set(fa))[:20]}


def run_json(exe: str, args: list[str], cache: Path) -> Any:
    shutil.rmtree(cache, ignore_errors=True)
    env = {**os.environ, "MIXFLEET_CACHE_DIR": str(cache)}
    p = subprocess.run([exe, *args], env=env, capture_output=True, text=True, cwd=ROOT)
    if p.returncode != 0:
        return {"error": (p.stderr or p.stdout).strip().splitlines()[-1:]}
    return json.loads(p.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--beside", required=True, metavar="REV", help="the other commit (e.g. the one before a move)")
    ap.add_argument("--updates", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plan-verify", type=int, default=3, help="--verify of the compared `mixfleet plan`")
    ap.add_argument("--changed", action="append", default=[], metavar="CASE=WHY",
                    help="a case whose results changed on purpose (a modelling change, not a move), with why; "
                         "listed in the results, not counted as a failure")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    changed = dict(c.split("=", 1) for c in args.changed)
    tmp = Path(tempfile.mkdtemp(prefix="mixfleet-same-"))
    try:
        other_bin = build(args.beside, tmp / "other")
        other_commit = subprocess.run(["git", "-C", str(tmp / "other"), "rev-parse", "HEAD"], capture_output=True,
                                      text=True, check=True).stdout.strip()
        this_exe, other_exe = shutil.which("mixfleet") or "mixfleet", str(other_bin / "mixfleet")
        rows = []
        plans = sorted((ROOT / "data" / "plans").glob("*.toml"))
        cases = [(p.stem, ["simulate", str(p), "-n", str(args.updates), "--seed", str(args.seed), "--json"])
                 for p in plans]
        cases += [(f"plan --verify {args.plan_verify}", ["plan", "--json", "--verify", str(args.plan_verify)]),
                  ("plan (defaults)", ["plan", "--json"])]
        for name, cmd in cases:
            t0 = time.perf_counter()
            a = run_json(this_exe, cmd, tmp / "cache")
            b = run_json(other_exe, cmd, tmp / "cache")
            if "error" in a or "error" in b:
                row = {"case": name, "command": "mixfleet " + " ".join(cmd), "this_error": a.get("error"),
                       "other_error": b.get("error")}
            else:
                row = {"case": name, "command": "mixfleet " + " ".join(cmd), **compare(a, b)}
            if name in changed:
                row["changed_on_purpose"] = changed[name]
            rows.append(row)
            verdict = ("new here" if row.get("other_error") and not row.get("this_error") else   # e.g. a new table
                       "error" if "this_error" in row else
                       "same" if row["n_differ"] == 0 else f"{row['n_differ']} differ")
            verdict += " (on purpose)" if name in changed and verdict != "same" else ""
            print(f"{name:32s} {verdict:10s} {row.get('compared', 0):5d} values  ({time.perf_counter() - t0:.0f} s)",
                  flush=True)
        out = {"this": head(), "other": other_commit, "updates": args.updates, "seed": args.seed,
               "date": time.strftime("%Y-%m-%d", time.gmtime()), "rows": rows}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=2))
        print(f"wrote {args.out}")
        # a plan only this tree reads (a table added since) is listed, not a failure
        sys.exit(0 if all(r.get("n_differ", 0 if r.get("other_error") and not r.get("this_error") else 1) == 0
                          for r in rows if r["case"] != "plan (defaults)" and "changed_on_purpose" not in r) else 1)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
