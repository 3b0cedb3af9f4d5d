"""The twin's engine floor: what the event machinery alone costs per event, with the twin's bare entries.

`TwinEnvironment.push` + `run` with a Python callback that only re-pushes its entry at a random delay,
`--queued` entries in flight (the seed-scale twin keeps ~4,000-5,000: sessions in tool calls plus replica
wake-ups). The entries run on the calendar (twin/core.py, compiled where the install could) inside SimPy's
run loop; the world's own hot entries (wake-ups, tool-call ends) are dispatched there without a Python call,
so for them this is an upper bound on the machinery and a lower bound on nothing else. No model work at all.
Together with the events a seed-scale update takes (`benchmarks/twin_speed.py`) it says how much of a dry
run's time the engine itself needs. Prints the figures and writes benchmarks/results/twin_engine_floor.json.

    python benchmarks/twin_engine_floor.py [--events 3000000] [--queued 2000]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import time
from pathlib import Path

import mixfleet.twin.core as core
import simpy
from mixfleet.twin.engine import Entry, TwinEnvironment

OUT = Path(__file__).resolve().parent / "results" / "twin_engine_floor.json"
SEED_EVENTS_PER_UPDATE = 156_704      # seed-mixed, 200 updates cold (twin_speed.py: 31,340,705 events)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=3_000_000)
    ap.add_argument("--queued", type=int, default=4_000)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()

    env = TwinEnvironment()
    rnd = random.Random(0)
    count = [0]

    def again(entry: Entry) -> None:
        count[0] += 1
        if count[0] < args.events:
            entry.callbacks = callbacks
            env.push(rnd.random() * 10.0, entry)

    callbacks = [again]
    for i in range(args.queued):
        env.push(rnd.random() * 10.0, Entry(callbacks, i))
    c0 = time.process_time()
    env.run()
    cpu_s = time.process_time() - c0
    per_event_us = cpu_s / count[0] * 1e6
    out = {"events": count[0], "queued": args.queued, "cpu_s": cpu_s, "cpu_us_per_event": per_event_us,
           "seed_events_per_update": SEED_EVENTS_PER_UPDATE,
           "engine_cpu_s_for_200_seed_updates": per_event_us * 1e-6 * SEED_EVENTS_PER_UPDATE * 200,
           "core_compiled": core.COMPILED, "simpy": simpy.__version__, "python": platform.python_version(),
           "machine": {"cpus": os.cpu_count(), "load_avg_1m": os.getloadavg()[0]}}
    print(json.dumps(out, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
