"""Benchmark: forward+backward time and peak memory of the naive, chunked and fused SC+MIS policy loss.

Why: the loss must never materialize [T, V] float32 log-probs (at 256K-token contexts and a ~150K
vocabulary that is ~150 GB), and the trainer should not build the [T, V] logits either. From the
output layer's input (`--H`, default 1024: hidden [T, H] and weight [V, H] in --dtype), three variants
run forward + backward down to the gradients of hidden and weight:
- naive:   policy_loss(hidden @ weight.T, implementation="naive")  (the plain autograd reference)
- chunked: policy_loss(hidden @ weight.T)                           (the chunked kernel; [T, V] logits exist)
- fused:   policy_loss_from_hidden(hidden, weight)                  (the output layer fused in; no [T, V])
and the largest |gradient difference| of chunked and fused against naive (or against chunked where
naive is not run) is reported. `--H 0` measures the loss alone from given [T, V] logits (naive vs
chunked, the earlier form of this benchmark).

Each (implementation, size) runs in a fresh subprocess so peaks do not leak between variants:
- CPU: peak resident memory (ru_maxrss) minus the resident memory after the inputs were built (the
  logits are filled chunk by chunk so building them leaves no earlier, higher peak);
- CUDA: torch.cuda.max_memory_allocated() minus the memory allocated after the inputs were built.
"peak_bytes" includes the gradients every implementation must return (of hidden and weight; with
--H 0 of the [T, V] logits), in the inputs' dtype; "working_bytes" is what the loss needs beside them:
the larger of the forward's peak (before the gradients exist) and the peak minus those buffers.

    python benchmarks/loss_memory.py --dtype bf16 --sizes 8192x32000,2048x151936
    python benchmarks/loss_memory.py --dtype bf16 --T 8192 --V 151936 --variants chunked,fused
    python benchmarks/loss_memory.py --device cuda --T 65536 --V 151936 --dtype bf16 [--H 4096]
    python benchmarks/loss_memory.py --H 0 [--dtype bf16]  # the loss alone from [T, V] logits

Prints a table and writes JSON to benchmarks/results/loss_memory_hidden_<device>_<dtype>.json (--H 0:
loss_memory.json for CPU fp32, else loss_memory_<device>_<dtype>.json; or --out).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS_PATH = Path(__file__).resolve().parent / "results" / "loss_memory.json"
DTYPES = ("fp32", "bf16")
TOPK = 128                     # the sampler's top-K record per token (CORRECTIONS default)
PEAK_RATIO_GOAL = 8.0          # --H 0: chunked peak at least this many times below naive
TIME_RATIO_GOAL = 1.5          # --H 0: chunked time at most this many times naive
FUSED_PEAK_RATIO_GOAL = 50.0   # issue 19: fused peak at least this many times below naive
FUSED_TIME_RATIO_GOAL = 1.2    # issue 19: fused time at most this many times naive
VARIANTS = ("naive", "chunked", "fused")
PAGE_BYTES = resource.getpagesize()


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE_BYTES


def max_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def child(impl: str, device: str, t: int, v: int, h: int, dtype_name: str, chunk: int, repeats: int,
          grads_out: str | None) -> dict:
    """One implementation at one size, in this (fresh) process. Returns the measurements."""
    import torch
    from mixfleet.runner.corrections import CorrectionBatch, CorrectionConfig, policy_loss, policy_loss_from_hidden

    torch.manual_seed(0)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    dev = torch.device(device)

    def filled(rows: int, cols: int, scale: float) -> torch.Tensor:
        out = torch.empty(rows, cols, dtype=dtype, device=dev)
        for r0 in range(0, rows, 256):  # fill in slices: no large fp32 temporary before the measurement
            out[r0:r0 + 256] = (torch.randn(min(256, rows - r0), cols, device=dev) * scale).to(dtype)
        return out

    if h > 0:   # the output layer's input and weight; logits hidden @ weight.T of scale ~2 like the logits below
        inputs = [filled(t, h, 1.0).requires_grad_(True), filled(v, h, 2.0 / h**0.5).requires_grad_(True)]
    else:
        inputs = [filled(t, v, 2.0).requires_grad_(True)]
    base = torch.randint(0, v, (t, 1), device=dev)
    topk_ids = (base + torch.arange(TOPK, device=dev) * 7) % v          # K distinct ids per row
    topk_lp = torch.log_softmax(torch.randn(t, TOPK, device=dev), dim=1) + torch.log(torch.tensor(0.9))
    labels = topk_ids[:, 0].clone()
    batch = CorrectionBatch(
        labels=labels, advantages=torch.randn(t, device=dev), loss_mask=torch.rand(t, device=dev) > 0.1,
        sampler_logprobs=topk_lp[:, 0] + 0.1 * torch.randn(t, device=dev),
        topk_ids=topk_ids, topk_logprobs=topk_lp, group_ids=torch.randint(0, 4, (t,), device=dev),
    )
    cfg = CorrectionConfig(method="sc_mis", implementation="naive" if impl == "naive" else "chunked",
                           chunk_size=chunk)

    def loss_of() -> tuple[torch.Tensor, dict]:
        if h == 0:
            return policy_loss(inputs[0], batch, cfg)
        if impl == "fused":
            return policy_loss_from_hidden(inputs[0], inputs[1], batch, cfg)
        return policy_loss(inputs[0] @ inputs[1].T, batch, cfg)

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
    cpu0 = os.times()
    for i in range(repeats):
        for x in inputs:
            x.grad = None
        sync()
        t0 = time.perf_counter()
        loss, metrics = loss_of()
        if i == 0:
            sync()
            forward_peak = peak_now()  # before the gradient buffers exist
        loss.backward()
        sync()
        times.append(time.perf_counter() - t0)
    cpu1 = os.times()
    cpu_s = ((cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)) / repeats
    peak = peak_now()
    if dev.type == "cuda":
        name = torch.cuda.get_device_name(dev)
        note = ""
    else:
        name = platform.processor() or platform.machine()
        note = "" if pre_peak <= base_bytes + (64 << 20) else f"setup peak {pre_peak - base_bytes} B above baseline"
    grad_bytes = sum(x.numel() * x.element_size() for x in inputs)
    if grads_out:
        torch.save([x.grad.cpu() for x in inputs], grads_out)
    return {
        "implementation": impl, "T": t, "V": v, "H": h, "dtype": dtype_name, "chunk_size": chunk,
        "time_s": statistics.median(times), "times_s": times, "cpu_s": cpu_s, "peak_bytes": peak,
        "forward_peak_bytes": forward_peak, "working_bytes": max(forward_peak, peak - grad_bytes),
        "grad_bytes": grad_bytes, "loss": float(loss),
        "k1": metrics["k1"], "device_name": name, "note": note,
    }


def run_child(impl: str, args: argparse.Namespace, t: int, v: int, grads_out: Path) -> dict:
    cmd = [sys.executable, __file__, "--child", impl, "--device", args.device, "--T", str(t), "--V", str(v),
           "--H", str(args.H), "--dtype", args.dtype, "--chunk-size", str(args.chunk_size),
           "--repeats", str(args.repeats), "--grads-out", str(grads_out)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines()[-1:] or [f"exit status {done.returncode} (killed?)"]
        return {"implementation": impl, "T": t, "V": v, "error": tail}
    return json.loads(done.stdout.strip().splitlines()[-1])


def grad_differences(ref: Path, other: Path, names: tuple[str, ...]) -> dict[str, float]:
    """max |grad - grad_ref| per input (and relative to max |grad_ref|), in fp32."""
    import torch

    a, b = torch.load(ref), torch.load(other)
    out = {}
    for name, x, y in zip(names, a, b, strict=True):
        diff = float((x.float() - y.float()).abs().max())
        out[f"max_abs_grad_diff_{name}"] = diff
        out[f"rel_grad_diff_{name}"] = diff / max(float(x.float().abs().max()), 1e-30)
    return out


def gib(n: float) -> str:
    return f"{n / 2**30:8.3f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--T", type=int, default=None, help="tokens (with --V: one size instead of --sizes)")
    ap.add_argument("--V", type=int, default=None, help="vocabulary size")
    ap.add_argument("--H", type=int, default=1024,
                    help="hidden size of the output layer (0: the loss alone from given [T, V] logits)")
    ap.add_argument("--sizes", default="8192x32000,2048x151936", help="comma-separated TxV list")
    ap.add_argument("--variants", default=None,
                    help="comma-separated subset of naive,chunked,fused (default: all; fused needs --H > 0)")
    ap.add_argument("--dtype", default="fp32", choices=DTYPES, help="dtype of the logits")
    ap.add_argument("--chunk-size", type=int, default=512, help="rows per chunk (the CorrectionConfig default)")
    ap.add_argument("--repeats", type=int, default=3, help="timed forward+backward runs (median reported)")
    ap.add_argument("--out", type=Path, default=None,
                    help="JSON path (default results/loss_memory.json; _<device>_<dtype> added unless cpu fp32)")
    ap.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    ap.add_argument("--grads-out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.device, args.T, args.V, args.H, args.dtype, args.chunk_size,
                               args.repeats, args.grads_out)))
        return
    if (args.T is None) != (args.V is None):
        ap.error("--T and --V go together")
    if args.H < 0:
        ap.error(f"--H = {args.H}; allowed: 0 (logits given) or a hidden size > 0")
    if args.variants is None:
        args.variants = "naive,chunked,fused" if args.H else "naive,chunked"
    variants = [x for x in args.variants.split(",") if x]
    bad = [x for x in variants if x not in VARIANTS or (x == "fused" and args.H == 0)]
    if bad or not variants:
        ap.error(f"--variants {args.variants!r}; allowed: a subset of {', '.join(VARIANTS)} (fused needs --H > 0)")
    sizes = [(args.T, args.V)] if args.T else [tuple(int(x) for x in s.split("x")) for s in args.sizes.split(",")]

    runs = []
    load_start = list(os.getloadavg())
    print(f"{'impl':8} {'T':>6} {'V':>7} {'H':>5} {'dtype':5} {'time_s':>8} {'cpu_s':>8} {'peak_GiB':>9} "
          f"{'work_GiB':>9}")
    with tempfile.TemporaryDirectory(prefix="loss_memory_") as tmp:
        for t, v in sizes:
            row: dict = {"T": t, "V": v, "H": args.H}
            grads = {impl: Path(tmp) / f"{impl}_{t}x{v}.pt" for impl in variants}
            for impl in variants:
                res = run_child(impl, args, t, v, grads[impl])
                row[impl] = res
                if "error" in res:
                    print(f"{impl:8} {t:6d} {v:7d} {args.H:5d} {args.dtype:5} failed: {res['error']}")
                else:
                    print(f"{impl:8} {t:6d} {v:7d} {args.H:5d} {args.dtype:5} {res['time_s']:8.3f} "
                          f"{res['cpu_s']:8.2f} {gib(res['peak_bytes'])}  {gib(res['working_bytes'])}")
            ok = [i for i in variants if "error" not in row[i]]
            ref = ok[0] if ok else None
            for impl in ok[1:]:
                r, c = row[ref], row[impl]
                row[impl]["reference"] = ref
                names = ("hidden", "weight") if args.H else ("logits",)
                row[impl].update(grad_differences(grads[ref], grads[impl], names))
                row[impl]["peak_ratio"] = r["peak_bytes"] / max(c["peak_bytes"], 1)
                row[impl]["working_ratio"] = r["working_bytes"] / max(c["working_bytes"], 1)
                row[impl]["time_ratio"] = c["time_s"] / r["time_s"]
                row[impl]["cpu_time_ratio"] = c["cpu_s"] / r["cpu_s"]
                if ref == "naive" and impl == "chunked" and args.H == 0:
                    row["goals_met"] = {"peak_ratio>=8": c["peak_ratio"] >= PEAK_RATIO_GOAL,
                                        "time_ratio<=1.5": c["time_ratio"] <= TIME_RATIO_GOAL}
                if ref == "naive" and impl == "fused":
                    row["goals_met"] = {"peak_ratio>=50": c["peak_ratio"] >= FUSED_PEAK_RATIO_GOAL,
                                        "time_ratio<=1.2": c["time_ratio"] <= FUSED_TIME_RATIO_GOAL,
                                        "cpu_time_ratio<=1.2": c["cpu_time_ratio"] <= FUSED_TIME_RATIO_GOAL}
                diffs = ", ".join(f"{k[len('max_abs_grad_diff_'):]} {c[k]:.3g}" for k in c if k.startswith("max_abs"))
                print(f"   {ref}/{impl}: peak {c['peak_ratio']:.1f}x (working {c['working_ratio']:.1f}x), "
                      f"time {impl}/{ref} {c['time_ratio']:.2f}x (CPU {c['cpu_time_ratio']:.2f}x), "
                      f"max |grad diff| {diffs}")
            for f in grads.values():
                f.unlink(missing_ok=True)
            runs.append(row)
    device_name = next((r[i]["device_name"] for r in runs for i in variants if "device_name" in r[i]), "")
    out = {"benchmark": "loss_memory", "method": "sc_mis", "topk": TOPK, "device": args.device,
           "device_name": device_name, "dtype": args.dtype, "chunk_size": args.chunk_size, "H": args.H,
           "variants": variants, "load_average_start_end": [load_start, list(os.getloadavg())],
           "memory_measure": "cuda max_memory_allocated" if args.device == "cuda" else "ru_maxrss - rss after setup",
           "runs": runs}
    path = args.out
    if path is None:
        if args.H > 0:
            path = RESULTS_PATH.with_name(f"loss_memory_hidden_{args.device}_{args.dtype}.json")
        elif args.device == "cpu" and args.dtype == "fp32":
            path = RESULTS_PATH
        else:
            path = RESULTS_PATH.with_name(f"loss_memory_{args.device}_{args.dtype}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
