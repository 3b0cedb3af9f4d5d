"""Benchmark: how fast the embedded engine's decode step reads cached KV on this CPU, per KV dtype.

Why (issue 42 item 4): on the CPU the decode step's per-sequence cost is mostly the KV read (and, for an FP8 KV
cache, its dequantization), growing with batch x context far below the memory bandwidth the roofline assumes;
with it at the bandwidth the twin's CPU replicas run as fast at 8 sequences as at 2, and a plan with other batch
sizes than the run it was calibrated on is mispredicted. For each KV dtype the engine (tiny model, BF16 weights,
FP32 kernel, one thread) decodes `--batches` at two prompt lengths; per prompt length a line
`step = a + s x batch` (`engine_throughput.step_line`), then `s` against the mean context gives the seconds per
cached token read: the KV dtype's read rate = KV bytes per token / that slope. The result is the catalog's
`kv_read_gb_s` for CPU-2core (data/accelerators.toml cites this file) divided by its eff_bw.

    python benchmarks/cpu_kv_read.py [--kv bf16,fp8_e4m3] [--prompts 100,700] [--batches 1,2,4,8,16]

Writes benchmarks/results/cpu_kv_read.json. Wall-clock figures: run it on a quiet machine (the load average
before and after is recorded).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_throughput import _one_run, step_line  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "cpu_kv_read.json"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kv", default="bf16,fp8_e4m3")
    ap.add_argument("--prompts", default="100,700", help="prompt lengths in tokens (at least two)")
    ap.add_argument("--batches", default="1,2,4,8,16")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()

    import torch
    from mixfleet.costmodel.specs.catalog import load_catalog
    from mixfleet.costmodel.specs.model import load_model_spec
    from mixfleet.costmodel.steptime.roofline import kv_bytes_per_token
    from mixfleet.runner.checkpoint.init_model import init_model
    from mixfleet.runner.sampler.engine import Engine

    torch.set_num_threads(1)
    prompts = [int(x) for x in args.prompts.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    if len(prompts) < 2:
        raise SystemExit("--prompts: at least two lengths (the slope over the context is what is measured)")
    load0 = os.getloadavg()[0]
    spec = load_model_spec("tiny")
    cat = load_catalog()
    out: dict = {"benchmark": "cpu_kv_read", "model": "tiny (seeded init), bf16 weights, fp32 kernel, 1 thread",
                 "torch": torch.__version__, "cpu_count": os.cpu_count(), "batches": batches, "prompts": prompts,
                 "new_tokens": args.new_tokens, "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                 "kv": {}}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = str(init_model(spec, Path(tmp) / "tiny", seed=0))
        for kv in args.kv.split(","):
            engine = Engine(ckpt, precision="bf16", kv_cache_dtype=kv, kernel="fp32")
            _one_run(engine, 2, 4, "warmup")
            lines = {}
            for pt in prompts:
                by_batch = {}
                for b in batches:
                    runs = [_one_run(engine, b, args.new_tokens, f"{kv}-{pt}-{b}-{k}", prompt_tokens=pt)
                            for k in range(args.repeats)]
                    by_batch[b] = min(runs, key=lambda r: r["mean_decode_step_ms"])
                prompt_len = by_batch[batches[0]]["prompt_tokens_mean"]
                lines[pt] = {**step_line(by_batch), "mean_context": prompt_len + args.new_tokens / 2.0,
                             "steps_ms": {b: r["mean_decode_step_ms"] for b, r in by_batch.items()}}
                print(f"kv {kv:>9} prompt {pt:>4}: step = {lines[pt]['intercept_ms']:.2f} ms + "
                      f"{lines[pt]['per_seq_ms']:.3f} ms x batch (mean context {lines[pt]['mean_context']:.0f})",
                      flush=True)
            ctx = np.array([lines[p]["mean_context"] for p in prompts])
            slope = np.array([lines[p]["per_seq_ms"] for p in prompts]) * 1e-3
            s_per_token, s0 = np.polyfit(ctx, slope, 1)
            kv_bytes = kv_bytes_per_token(spec, cat.kv_dtype(kv), 1)
            rate = kv_bytes / s_per_token
            out["kv"][kv] = {"lines": lines, "s_per_cached_token": float(s_per_token), "per_seq_rest_s": float(s0),
                             "kv_bytes_per_token": float(kv_bytes), "kv_read_gb_s": float(rate / 1e9)}
            print(f"kv {kv:>9}: {s_per_token * 1e6:.3f} us per cached token ({kv_bytes:.0f} B) -> "
                  f"{rate / 1e9:.3f} GB/s; rest of a sequence's step {s0 * 1e3:.3f} ms", flush=True)
    out["load_average_1m_before_after"] = [load0, os.getloadavg()[0]]
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
