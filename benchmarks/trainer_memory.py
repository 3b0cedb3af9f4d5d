"""Benchmark: the trainer's peak memory and time per update, with the corrections' policy loss through
the logits vs with the output layer fused into the loss, on the tiny models.

Why: `Trainer.train_step` used to run the GPTModel's output layer and hand [B, S, V] logits to
`policy_loss`; with `policy_loss_fn(cfg)` (an `OutputLayerLoss`) the model runs without its output
layer and `policy_loss_from_hidden` never builds them. This measures what that changes per update.

Each (model, path) runs in a fresh process: build the trainer (CPU, seed 0) and an SC+MIS batch of
B x S tokens with a top-8 sampler record, take one warm-up update (AdamW allocates its state), reset
the process's resident high-water mark (/proc/self/clear_refs 5), take the measured update; peak =
VmHWM after it minus VmRSS before it. Both paths take the same updates from the same weights, so their
loss and gradient norm are printed side by side (equal to rounding).

    python benchmarks/trainer_memory.py [--models tiny,tiny-qwen3,tiny-qwen3-moe] [--batch 32] [--seq 256]

Writes benchmarks/results/trainer_memory.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
import warnings
from pathlib import Path

RESULTS_PATH = Path(__file__).resolve().parent / "results" / "trainer_memory.json"
PATHS = ("logits", "fused")
TOPK = 8


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M).group(1))


def child(model: str, path: str, batch_size: int, seq: int) -> dict:
    warnings.filterwarnings("ignore")
    import torch
    from mixfleet.costmodel.specs.model import load_model_spec
    from mixfleet.runner.corrections import CorrectionBatch, CorrectionConfig
    from mixfleet.runner.trainer.megatron_model import BuildOptions
    from mixfleet.runner.trainer.trainer import Trainer, TrainerConfig, policy_loss_fn

    spec = load_model_spec(model)
    trainer = Trainer(spec, TrainerConfig(build=BuildOptions(device="cpu", seed=0)))
    g = torch.Generator().manual_seed(1)
    b, s, v = batch_size, seq, spec.vocab_size
    ids = torch.randint(16, v, (b, s), generator=g)
    labels = torch.zeros(b, s, dtype=torch.long)
    labels[:, :-1] = ids[:, 1:]
    mask = torch.zeros(b, s)
    mask[:, s // 4: s - 1] = 1.0                                  # a prompt quarter, then the completion
    q_logp = torch.log_softmax(torch.randn(b * s, v, generator=g) * 2, dim=-1)
    top_lp, top_ids = q_logp.topk(TOPK, dim=-1)
    cb = CorrectionBatch(labels=labels.reshape(-1), advantages=torch.randn(b, generator=g).repeat_interleave(s),
                         loss_mask=mask.reshape(-1), sampler_logprobs=q_logp.gather(1, labels.reshape(-1, 1))[:, 0],
                         topk_ids=top_ids, topk_logprobs=top_lp, group_ids=torch.arange(b).repeat_interleave(s) % 2)
    del q_logp
    batch = {"input_ids": ids, "correction": cb}
    loss_fn = policy_loss_fn(CorrectionConfig(method="sc_mis"), fused=path == "fused")
    warm = trainer.train_step(batch, loss_fn)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")                                              # reset VmHWM to the current RSS
    base = _status_kib("VmRSS")
    cpu0 = os.times()
    t0 = time.perf_counter()
    m = trainer.train_step(batch, loss_fn)
    wall = time.perf_counter() - t0
    cpu1 = os.times()
    peak = _status_kib("VmHWM") - base
    return {"model": model, "path": path, "B": b, "S": s, "tokens": b * s, "vocab": v,
            "padded_vocab": trainer.padded_vocab_size, "hidden": spec.hidden_size,
            "peak_bytes": peak * 1024, "step_s": wall,
            "step_cpu_s": (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system),
            "loss": m["loss"], "grad_norm": m["grad_norm"], "warmup_loss": warm["loss"],
            "logits_bytes_fp32": b * s * trainer.padded_vocab_size * 4}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="tiny,tiny-qwen3,tiny-qwen3-moe")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--out", type=Path, default=RESULTS_PATH)
    ap.add_argument("--child", nargs=2, metavar=("MODEL", "PATH"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], args.child[1], args.batch, args.seq)))
        return
    load_start = list(os.getloadavg())
    rows = []
    print(f"{'model':16} {'path':7} {'tokens':>6} {'peak_MiB':>9} {'step_s':>7} {'cpu_s':>7} {'loss':>10} "
          f"{'grad_norm':>10}")
    for model in [m for m in args.models.split(",") if m]:
        row: dict = {"model": model}
        for path in PATHS:
            cmd = [sys.executable, __file__, "--child", model, path, "--batch", str(args.batch), "--seq", str(args.seq)]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                row[path] = {"error": done.stderr.strip().splitlines()[-1:]}
                print(f"{model:16} {path:7} failed: {row[path]['error']}")
                continue
            r = row[path] = json.loads(done.stdout.strip().splitlines()[-1])
            print(f"{model:16} {path:7} {r['tokens']:6d} {r['peak_bytes'] / 2**20:9.1f} {r['step_s']:7.2f} "
                  f"{r['step_cpu_s']:7.2f} {r['loss']:10.6f} {r['grad_norm']:10.6f}")
        if all("error" not in row.get(p, {"error": 1}) for p in PATHS):
            lo, fu = row["logits"], row["fused"]
            row["peak_ratio"] = lo["peak_bytes"] / max(fu["peak_bytes"], 1)
            row["peak_saved_bytes"] = lo["peak_bytes"] - fu["peak_bytes"]
            row["cpu_time_ratio"] = fu["step_cpu_s"] / lo["step_cpu_s"]
            row["grad_norm_rel_diff"] = abs(fu["grad_norm"] - lo["grad_norm"]) / lo["grad_norm"]
            print(f"   logits/fused peak {row['peak_ratio']:.2f}x ({row['peak_saved_bytes'] / 2**20:.1f} MiB less), "
                  f"CPU time fused/logits {row['cpu_time_ratio']:.2f}x, "
                  f"grad norm rel. diff {row['grad_norm_rel_diff']:.1e}")
        rows.append(row)
    out = {"benchmark": "trainer_memory", "method": "sc_mis", "topk": TOPK, "batch": args.batch, "seq": args.seq,
           "device": "cpu", "memory_measure": "VmHWM after the update - VmRSS before it (high-water mark reset)",
           "load_average_start_end": [load_start, list(os.getloadavg())], "runs": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
