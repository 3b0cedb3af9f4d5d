"""Benchmark: generated tokens/s of the embedded engine at batch 1, 8, 32, per weight precision.

Why: continuous batching must pay off (goal: batch 32 gives at least 6x the tokens/s of batch 1 on
this CPU for the tiny model), and each precision's cost on the engine shows what dequantize-then-
matmul costs. For every (precision, batch) the engine gets `batch` requests at once (sampled at
T = 1 with log-prob records, EOS ignored, `--new-tokens` each) and runs until all finish; we report
end-to-end tokens/s (prefill included) and steady decode tokens/s (the decode-only steps). Best of
`--repeats`. Results: JSON in benchmarks/results/engine_throughput.json (device named).

    python benchmarks/engine_throughput.py [--model CKPT|SPEC] [--precisions fp32,bf16,fp8,nvfp4,mxfp4]
        [--batches 1,8,32] [--new-tokens 64] [--kv bf16] [--kernel bf16] [--threads 1]
        [--device cuda] [--fp8-scaled-mm] [--return-routed-experts]

--model is a checkpoint folder or a shipped spec name (`tiny-qwen3-moe`: a seeded checkpoint of it is written
to a temporary folder; the default is `tiny`); a spec other than tiny writes
benchmarks/results/engine_throughput_<spec>.json. `--return-routed-experts` (MoE) records every token's
experts, as a routing-replay run asks the sampler to. CPU seconds of the process are reported per run
(on a shared machine wall time is noisy; compare ratios within one run). `--device cuda` runs on
a GPU; `--fp8-scaled-mm` adds an fp8 row whose linears run real FP8 GEMMs (`torch._scaled_mm`:
Hopper or newer, or CPU) next to the dequantize-then-bf16 fp8 row.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "engine_throughput.json"


def _device_name(device: str) -> str:
    import torch

    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _one_run(engine, batch: int, new_tokens: int, tag: str, routed: bool = False, prompt_tokens: int = 0) -> dict:
    from mixfleet.runner.sampler.engine_api import EngineRequest, SamplingParams

    done: dict[str, int] = {}
    prompt_lens = []
    for i in range(batch):
        text = f"Benchmark request {i}: write something long."
        if prompt_tokens:           # pad the prompt to about `prompt_tokens` tokens (the context decode runs at)
            text = (text + " " + "lorem ipsum dolor sit amet " * prompt_tokens)[:max(prompt_tokens - 16, 1)]
        ids = engine.tokenizer.encode(f"<|user|>{text}<|assistant|>")
        prompt_lens.append(len(ids))
        engine.add_request(EngineRequest(rid=f"{tag}-{i}", input_ids=ids, return_logprob=True,
                                         return_routed_experts=routed,
                                         params=SamplingParams(max_new_tokens=new_tokens, temperature=1.0,
                                                               ignore_eos=True, sampling_seed=i)),
                           on_finish=lambda r: done.__setitem__(r.rid, len(r.output_ids)))
    step_s: list[float] = []
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    while True:
        t = time.perf_counter()
        if not engine.step():
            break
        step_s.append(time.perf_counter() - t)
    wall_s = time.perf_counter() - t0
    cpu_s = time.process_time() - cpu0
    tokens = sum(done.values())
    decode_steps = step_s[1:]                       # step 0 admits + prefills the whole batch
    decode_tokens = tokens - 2 * batch              # step 0 yields 2 tokens per request (prefill + decode)
    return {"tokens": tokens, "wall_s": wall_s, "cpu_s": cpu_s, "tokens_per_s": tokens / wall_s,
            "tokens_per_cpu_s": tokens / cpu_s if cpu_s > 0 else 0.0,
            "decode_tokens_per_s": decode_tokens / sum(decode_steps) if decode_steps else 0.0,
            "mean_decode_step_ms": 1e3 * sum(decode_steps) / max(len(decode_steps), 1),
            "prompt_tokens_mean": sum(prompt_lens) / len(prompt_lens)}


def step_line(by_batch: dict[int, dict]) -> dict[str, float]:
    """Least-squares line of the mean decode step (ms) over the batches: intercept (per step, whatever the batch)
    and per-sequence slope, the two figures a CPU accelerator's catalog entry takes (`decode_overhead_s`,
    `decode_overhead_per_seq_s`)."""
    import numpy as np

    b = np.array(sorted(by_batch), dtype=np.float64)
    ms = np.array([by_batch[int(x)]["mean_decode_step_ms"] for x in b])
    slope, icpt = np.polyfit(b, ms, 1)
    fit = icpt + slope * b
    return {"intercept_ms": float(icpt), "per_seq_ms": float(slope),
            "max_rel_residual": float(np.max(np.abs(fit - ms) / ms)),
            "per_seq_share_at_max": float(slope * b[-1] / (icpt + slope * b[-1]))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny",
                    help="checkpoint folder, or a shipped spec name written seeded to a temp folder (default tiny)")
    ap.add_argument("--precisions", default="fp32,bf16,fp8,nvfp4,mxfp4")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=0,
                    help="pad each prompt to about this many tokens (0: a one-line prompt)")
    ap.add_argument("--kv", default="bf16", help="KV-cache dtype: bf16, fp8_e4m3, fp32")
    ap.add_argument("--kernel", default=None, help="matmul dtype fp32 | bf16 (default: per precision)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--fp8-scaled-mm", action="store_true", help="add fp8 with torch._scaled_mm (Hopper+ or CPU)")
    ap.add_argument("--return-routed-experts", action="store_true", help="MoE: record every token's experts")
    ap.add_argument("--out", default=None, help=f"JSON path (default {RESULTS}, or engine_throughput_<spec>.json)")
    args = ap.parse_args()

    import os

    import torch
    from mixfleet.costmodel.specs.model import load_model_spec
    from mixfleet.runner.checkpoint.init_model import init_model
    from mixfleet.runner.sampler.engine import Engine

    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    batches = [int(b) for b in args.batches.split(",")]
    variants = [(p, False) for p in args.precisions.split(",")]
    if args.fp8_scaled_mm:
        variants.append(("fp8", True))
    tmp = None
    model = args.model
    spec_name = None
    if not (Path(model) / "config.json").exists():     # a spec name (or TOML path): a seeded checkpoint of it
        spec = load_model_spec(model)
        spec_name = spec.name
        tmp = tempfile.TemporaryDirectory()
        model = str(init_model(spec, Path(tmp.name) / spec.name, seed=0))
    out_path = args.out or (str(RESULTS) if spec_name in (None, "tiny") else
                            str(RESULTS.with_name(f"engine_throughput_{spec_name}.json")))
    rows = []
    lines: dict[str, dict[str, float]] = {}
    for precision, scaled in variants:
        engine = Engine(model, precision=precision, kv_cache_dtype=args.kv, kernel=args.kernel, device=args.device,
                        fp8_scaled_mm=scaled, fp8_scaling="channel" if scaled else "block",
                        enable_return_routed_experts=args.return_routed_experts)
        _one_run(engine, 2, 4, "warmup", args.return_routed_experts)
        by_batch = {}
        for b in batches:
            runs = [_one_run(engine, b, args.new_tokens, f"{b}-{k}", args.return_routed_experts, args.prompt_tokens)
                    for k in range(args.repeats)]
            best = max(runs, key=lambda r: r["tokens_per_s"])
            by_batch[b] = best
            name = precision + ("+scaled_mm" if scaled else "")
            print(f"{name:>16} kernel {engine.kernel:>4} batch {b:>3}: {best['tokens_per_s']:8.0f} tok/s "
                  f"({best['tokens_per_cpu_s']:8.0f} tok/CPU-s; decode {best['decode_tokens_per_s']:8.0f} tok/s, "
                  f"{best['mean_decode_step_ms']:.2f} ms/step)", flush=True)
        if len(by_batch) >= 2:          # the decode step as a line in the batch: what a cost model's shape needs
            line = step_line(by_batch)
            lines[precision + ("+scaled_mm" if scaled else "")] = line
            print(f"{'':>16} step = {line['intercept_ms']:.2f} ms + {line['per_seq_ms']:.3f} ms x batch "
                  f"(per-sequence share at batch {batches[-1]}: {line['per_seq_share_at_max']:.0%})", flush=True)
        base = by_batch[batches[0]]["tokens_per_s"]
        base_cpu = by_batch[batches[0]]["tokens_per_cpu_s"] or 1.0
        for b, r in by_batch.items():
            rows.append({"precision": precision, "fp8_scaled_mm": scaled, "kernel": engine.kernel,
                         "kv_cache_dtype": args.kv, "batch": b, **r,
                         f"speedup_vs_batch_{batches[0]}": r["tokens_per_s"] / base,
                         f"cpu_speedup_vs_batch_{batches[0]}": r["tokens_per_cpu_s"] / base_cpu})
    out = {"benchmark": "engine_throughput", "device": args.device, "device_name": _device_name(args.device),
           "torch": torch.__version__, "threads": args.threads, "new_tokens": args.new_tokens,
           "prompt_tokens": args.prompt_tokens, "step_lines": lines,
           "model": f"{spec_name} (seeded init)" if spec_name else args.model,
           "return_routed_experts": args.return_routed_experts,
           "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "cpu_count": os.cpu_count(),
           "load_average_1m_before_after": [load_before, os.getloadavg()[0] if hasattr(os, "getloadavg") else None],
           "rows": rows}
    path = Path(out_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path}")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
