"""Benchmark: what the HTTP layer costs. Generated tokens/s through the embedded server vs the engine direct.

Why: every sampler call of the runner goes through runner/sampler/server.py (parse, engine thread hand-off,
JSON response); this shows how much of the engine's throughput survives the protocol layer at
1, 8 and 32 concurrent requests on the tiny model. For each concurrency level the same requests
(T = 1, log-probs and top-5 recorded, EOS ignored, `--new-tokens` each) run (a) straight on the
engine (`add_request`, wait for all) and (b) as concurrent POST /generate calls over loopback
through `SamplerClient`. Best of `--repeats`. Results: JSON in
benchmarks/results/sampler_server_throughput.json.

    python benchmarks/sampler_server_throughput.py [--model CKPT] [--precision bf16]
        [--concurrency 1,8,32] [--new-tokens 32] [--repeats 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import tempfile
import threading
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "sampler_server_throughput.json"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint folder (default: a seeded tiny checkpoint)")
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=str(RESULTS))
    a = ap.parse_args()

    import torch
    from mixfleet.costmodel.specs.model import load_model_spec
    from mixfleet.runner.checkpoint.init_model import init_model
    from mixfleet.runner.sampler.client import SamplerClient
    from mixfleet.runner.sampler.engine import Engine
    from mixfleet.runner.sampler.engine_api import EngineRequest, SamplingParams
    from mixfleet.runner.sampler.server import ServerArgs
    from mixfleet.runner.sampler.server_launch import start_in_thread

    model = a.model or str(init_model(load_model_spec("tiny"), Path(tempfile.mkdtemp()) / "tiny", seed=0))
    engine = Engine(model, precision=a.precision, kv_cache_dtype="bf16")
    prompt = list(range(16, 48))
    params = {"max_new_tokens": a.new_tokens, "temperature": 1.0, "ignore_eos": True}

    def direct(n: int) -> float:
        done = threading.Semaphore(0)
        stop = threading.Event()
        t = threading.Thread(target=engine.run_forever, args=(stop,))
        t.start()
        t0 = time.perf_counter()
        for i in range(n):
            engine.add_request(EngineRequest(rid=f"d{i}", input_ids=prompt, params=SamplingParams(**params),
                                             return_logprob=True, top_logprobs_num=5),
                               on_finish=lambda _r: done.release())
        for _ in range(n):
            done.acquire()
        dt = time.perf_counter() - t0
        stop.set()
        t.join()
        return n * a.new_tokens / dt

    async def over_http(url: str, n: int) -> float:
        async with SamplerClient(url) as c:
            t0 = time.perf_counter()
            outs = await asyncio.gather(*[c.generate_ids(prompt, params, top_logprobs_num=5) for _ in range(n)])
            dt = time.perf_counter() - t0
        assert all(len(o["output_ids"]) == a.new_tokens for o in outs)
        return n * a.new_tokens / dt

    direct(2)                                    # warm-up (first-call allocations, kernels)
    rows = []
    levels = [int(x) for x in a.concurrency.split(",")]
    for n in levels:
        rows.append({"concurrency": n, "direct_tokens_per_s": max(direct(n) for _ in range(a.repeats))})
    with start_in_thread(engine, server_args=ServerArgs(port=0)) as h:
        for row in rows:
            n = row["concurrency"]
            row["http_tokens_per_s"] = max(asyncio.run(over_http(h.url, n)) for _ in range(a.repeats))
            row["http_share_of_direct"] = row["http_tokens_per_s"] / row["direct_tokens_per_s"]
    result = {"benchmark": "sampler_server_throughput", "model": model, "precision": a.precision,
              "new_tokens": a.new_tokens, "device": "cpu", "torch_threads": torch.get_num_threads(),
              "machine": platform.processor() or platform.machine(),
              "load_average_1min": os.getloadavg()[0],    # a shared machine makes the numbers noisy
              "rows": rows}
    for row in rows:
        print(f"concurrency {row['concurrency']:>3}: direct {row['direct_tokens_per_s']:8.1f} tok/s   "
              f"http {row['http_tokens_per_s']:8.1f} tok/s   ({row['http_share_of_direct']:.0%})")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
