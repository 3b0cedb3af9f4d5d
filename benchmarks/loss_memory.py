"""Benchmark: forward+backward time and peak memory of the naive vs the chunked SC+MIS policy loss.

Why: the loss must never materialize [T, V] float32 log-probs (at 256K-token contexts and a ~150K
vocabulary that is ~150 GB). This measures what the chunked kernel of `mixfleet.runner.corrections`
saves, at the issue's size T = 8,192 tokens, V = 32,000 (plus the real 151,936 vocabulary at a
smaller T on CPU), and on a GPU when asked.

Each (implementation, size) runs in a fresh subprocess so peaks do not leak between variants:
- CPU: peak resident memory (ru_maxrss) minus the resident memory after the inputs were built (the
  logits are filled chunk by chunk so building them leaves no earlier, higher peak);
- CUDA: torch.cuda.max_memory_allocated() minus the memory allocated after the inputs were built.
"peak_bytes" includes the [T, V] gradient of the logits (in the logits' dtype), which every
implementation must return; "working_bytes" is what the loss needs beside it: the larger of the
forward's peak (before the gradient exists) and the peak minus that gradient buffer.

    python benchmarks/loss_memory.py                       # CPU: T=8192 V=32000 fp32, and T=2048 V=151936
    python benchmarks/loss_memory.py --sizes 8192x32000 --dtype bf16
    python benchmarks/loss_memory.py --device cuda --T 65536 --V 151936 --dtype bf16

Prints a table and writes JSON to benchmarks/results/loss_memory.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

RESULTS_PATH = Path(__file__).resolve().parent / "results" / "loss_memory.json"
DTYPES = ("fp32", "bf16")
TOPK = 128                     # the sampler's top-K record per token (CORRECTIONS default)
PEAK_RATIO_GOAL = 8.0          # chunked peak at least this many times below naive
TIME_RATIO_GOAL = 1.5          # chunked time at most this many times naive
PAGE_BYTES = resource.getpagesize()


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE_BYTES


def max_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def child(impl: str, device: str, t: int, v: int, dtype_name: str, chunk: int, repeats: int) -> dict:
    """One implementation at one size, in this (fresh) process. Returns the measurements."""
    import torch
    from mixfleet.runner.corrections import CorrectionBatch, CorrectionConfig, policy_loss

    torch.manual_seed(0)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    dev = torch.device(device)
    logits = torch.empty(t, v, dtype=dtype, device=dev)
    for r0 in range(0, t, 256):  # fill in slices: no [T, V] fp32 temporary before the measurement
        logits[r0:r0 + 256] = (torch.randn(min(256, t - r0), v, device=dev) * 2).to(dtype)
    base = torch.randint(0, v, (t, 1), device=dev)
    topk_ids = (base + torch.arange(TOPK, device=dev) * 7) % v          # K distinct ids per row
    topk_lp = torch.log_softmax(torch.randn(t, TOPK, device=dev), dim=1) + torch.log(torch.tensor(0.9))
    labels = topk_ids[:, 0].clone()
    batch = CorrectionBatch(
        labels=labels, advantages=torch.randn(t, device=dev), loss_mask=torch.rand(t, device=dev) > 0.1,
        sampler_logprobs=topk_lp[:, 0] + 0.1 * torch.randn(t, device=dev),
        topk_ids=topk_ids, topk_logprobs=topk_lp, group_ids=torch.randint(0, 4, (t,), device=dev),
    )
    cfg = CorrectionConfig(method="sc_mis", implementation=impl, chunk_size=chunk)
    x = logits.requires_grad_(True)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    sync()
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base_bytes = torch.cuda.memory_allocated()
    else:
        base_bytes = rss_bytes()
        pre_peak = max_rss_bytes()

    def peak_now() -> int:
        return (torch.cuda.max_memory_allocated() if dev.type == "cuda" else max_rss_bytes()) - base_bytes

    times = []
    forward_peak = 0
    for i in range(repeats):
        x.grad = None
        sync()
        t0 = time.perf_counter()
        loss, metrics = policy_loss(x, batch, cfg)
        if i == 0:
            sync()
            forward_peak = peak_now()  # before the gradient buffer exists
        loss.backward()
        sync()
        times.append(time.perf_counter() - t0)
    peak = peak_now()
    if dev.type == "cuda":
        name = torch.cuda.get_device_name(dev)
        note = ""
    else:
        name = platform.processor() or platform.machine()
        note = "" if pre_peak <= base_bytes + (64 << 20) else f"setup peak {pre_peak - base_bytes} B above baseline"
    grad_bytes = t * v * x.element_size()
    return {
        "implementation": impl, "T": t, "V": v, "dtype": dtype_name, "chunk_size": chunk,
        "time_s": statistics.median(times), "times_s": times, "peak_bytes": peak,
        "forward_peak_bytes": forward_peak, "working_bytes": max(forward_peak, peak - grad_bytes),
        "grad_bytes": grad_bytes, "loss": float(loss),
        "k1": metrics["k1"], "device_name": name, "note": note,
    }


def run_child(impl: str, args: argparse.Namespace, t: int, v: int) -> dict:
    cmd = [sys.executable, __file__, "--child", impl, "--device", args.device, "--T", str(t), "--V", str(v),
           "--dtype", args.dtype, "--chunk-size", str(args.chunk_size), "--repeats", str(args.repeats)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        return {"implementation": impl, "T": t, "V": v, "error": done.stderr.strip().splitlines()[-1:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def gib(n: float) -> str:
    return f"{n / 2**30:8.3f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--T", type=int, default=None, help="tokens (with --V: one size instead of --sizes)")
    ap.add_argument("--V", type=int, default=None, help="vocabulary size")
    ap.add_argument("--sizes", default="8192x32000,2048x151936", help="comma-separated TxV list")
    ap.add_argument("--dtype", default="fp32", choices=DTYPES, help="dtype of the logits")
    ap.add_argument("--chunk-size", type=int, default=512, help="rows per chunk (the CorrectionConfig default)")
    ap.add_argument("--repeats", type=int, default=3, help="timed forward+backward runs (median reported)")
    ap.add_argument("--out", type=Path, default=None,
                    help="JSON path (default results/loss_memory.json; _<device>_<dtype> added unless cpu fp32)")
    ap.add_argument("--child", choices=("naive", "chunked"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.device, args.T, args.V, args.dtype, args.chunk_size, args.repeats)))
        return
    if (args.T is None) != (args.V is None):
        ap.error("--T and --V go together")
    sizes = [(args.T, args.V)] if args.T else [tuple(int(x) for x in s.split("x")) for s in args.sizes.split(",")]

    runs = []
    print(f"{'impl':8} {'T':>6} {'V':>7} {'dtype':5} {'time_s':>8} {'peak_GiB':>9} {'work_GiB':>9}")
    for t, v in sizes:
        row = {"T": t, "V": v}
        for impl in ("naive", "chunked"):
            res = run_child(impl, args, t, v)
            row[impl] = res
            if "error" in res:
                print(f"{impl:8} {t:6d} {v:7d} {args.dtype:5} failed: {res['error']}")
            else:
                print(f"{impl:8} {t:6d} {v:7d} {args.dtype:5} {res['time_s']:8.3f} {gib(res['peak_bytes'])}  "
                      f"{gib(res['working_bytes'])}")
        if "error" not in row["naive"] and "error" not in row["chunked"]:
            n, c = row["naive"], row["chunked"]
            row["peak_ratio"] = n["peak_bytes"] / max(c["peak_bytes"], 1)
            row["working_ratio"] = n["working_bytes"] / max(c["working_bytes"], 1)
            row["time_ratio"] = c["time_s"] / n["time_s"]
            row["goals_met"] = {"peak_ratio>=8": row["peak_ratio"] >= PEAK_RATIO_GOAL,
                                "time_ratio<=1.5": row["time_ratio"] <= TIME_RATIO_GOAL}
            print(f"   peak naive/chunked {row['peak_ratio']:.1f}x (working memory {row['working_ratio']:.1f}x), "
                  f"time chunked/naive {row['time_ratio']:.2f}x")
        runs.append(row)
    device_name = next((r[i]["device_name"] for r in runs for i in ("naive", "chunked") if "device_name" in r[i]), "")
    out = {"benchmark": "loss_memory", "method": "sc_mis", "topk": TOPK, "device": args.device,
           "device_name": device_name, "dtype": args.dtype, "chunk_size": args.chunk_size,
           "memory_measure": "cuda max_memory_allocated" if args.device == "cuda" else "ru_maxrss - rss after setup",
           "runs": runs}
    path = args.out
    if path is None:
        default = args.device == "cpu" and args.dtype == "fp32"
        path = RESULTS_PATH if default else RESULTS_PATH.with_name(f"loss_memory_{args.device}_{args.dtype}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
