"""The CI learning guard's counter-cases, run by hand through the test's own code path.

    nice -n 10 python benchmarks/learning_counter_cases.py [--fault none|sign|...|all]

Runs `pytest tests/test_learning_guard.py` once per fault with LEARNING_GUARD_FAULT=<fault> (the test injects it:
a flipped loss sign, lr 0, shuffled rewards, the MIS weight inverted or its mask dropping every token, the score
centering's sign flipped or taken against the trainer's p, a top-p replay that ignores the kept set). "none" must
pass and every fault must fail. Writes each run's exit code and first assertion line to
benchmarks/results/learning_counter_cases.json under "guard". No fault stays in the suite; the rates over many
seeds are benchmarks/learning_guard_rates.py's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "learning_counter_cases.json"


def run_guard_fault(fault: str) -> dict[str, Any]:
    """pytest tests/test_learning_guard.py with LEARNING_GUARD_FAULT=fault: exit code and the failing assertion."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pytest", "tests/test_learning_guard.py", "-q", "-x", "-p",
                           "no:cacheprovider"], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "LEARNING_GUARD_FAULT": fault})
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("E ")]
    return {"fault": fault, "returncode": proc.returncode, "test_passes": proc.returncode == 0,
            "assertion": lines[0][2:].strip()[:400] if lines else "", "wall_s": time.perf_counter() - t0}


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(ROOT / "tests"))
    import test_learning_guard as g

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fault", default="all", help=f"all, or one of {', '.join(g.FAULTS)}")
    args = ap.parse_args(argv)
    if args.fault != "all" and args.fault not in g.FAULTS:
        ap.error(f"--fault {args.fault!r}; allowed: all, {', '.join(g.FAULTS)}")
    out = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    guard = out.setdefault("guard", {})
    wrong = 0
    for fault in g.FAULTS if args.fault == "all" else (args.fault,):
        r = guard[fault] = run_guard_fault(fault)
        ok = r["test_passes"] == (fault == "none")
        wrong += not ok
        print(f"{fault}: the test {'passes' if r['test_passes'] else 'fails'} ({'as it must' if ok else 'WRONG'}; "
              f"{r['wall_s']:.0f} s) {r['assertion'][:160]}", flush=True)
        RESULTS.write_text(json.dumps(out, indent=1) + "\n")
    return 1 if wrong else 0


if __name__ == "__main__":
    raise SystemExit(main())
