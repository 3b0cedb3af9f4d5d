"""Where the test suite's time goes, per xdist group: sums the `--durations=0` lines of a pytest log.

    python3 -m pytest -n 2 --durations=0 > suite.log
    python benchmarks/suite_durations.py suite.log [--top 30] [--out benchmarks/results/suite_durations.json]

A group is a test file, or the shared group of tests/conftest.py's SHARED_RUNS; its seconds are its tests' setup,
call and teardown together (its module fixtures' real runs included). Prints the groups longest first, with the
sum over all and the longest group against the wall time the log reports: tests/conftest.py's SLOWEST_FIRST is
meant to be the head of this list.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import SHARED_RUNS, SLOWEST_FIRST  # noqa: E402  (the groups as the suite makes them)

LINE = re.compile(r"^([\d.]+)s (setup|call|teardown)\s+tests/([^:]+)::")
WALL = re.compile(r" in ([\d.]+)s \(")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log", type=Path)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    text = args.log.read_text(errors="replace")
    per: dict[str, float] = defaultdict(float)
    for line in text.splitlines():
        m = LINE.match(line)
        if m:
            name = Path(m.group(3)).name
            per[SHARED_RUNS.get(name, name)] += float(m.group(1))
    if not per:
        raise SystemExit(f"{args.log}: no --durations lines (run pytest with --durations=0)")
    walls = WALL.findall(text)
    ranked = sorted(per.items(), key=lambda kv: -kv[1])
    total = sum(per.values())
    for group, sec in ranked[:args.top]:
        mark = "*" if group in SLOWEST_FIRST else " "
        print(f"{sec:8.1f} s {mark} {group}")
    print(f"{total:8.1f} s   all {len(per)} groups (test seconds; * = in SLOWEST_FIRST)"
          + (f"; wall {float(walls[-1]):.0f} s" if walls else ""))
    if args.out:
        args.out.write_text(json.dumps({"log": str(args.log), "total_s": total,
                                        "wall_s": float(walls[-1]) if walls else None,
                                        "groups": dict(ranked)}, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
