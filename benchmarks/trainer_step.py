"""How long the tiny model's trainer takes on this machine: one train step (forward, loss, backward,
clip, AdamW) on a batch of B x S tokens, the HF export, and a resumable-state save. Prints the
numbers and writes them as JSON (no assertions: speed depends on the machine and its load).

    python benchmarks/trainer_step.py [--batch 128] [--seq 256] [--steps 3] [--out benchmarks/results/trainer_step.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
import warnings
from pathlib import Path

import torch

warnings.filterwarnings("ignore")


def nll_loss(logits: torch.Tensor, batch: dict) -> tuple[torch.Tensor, dict]:
    ids = batch["input_ids"]
    lp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
    return -lp.mean(), {}


def main() -> None:
    from mixfleet.costmodel.specs.model import load_model_spec
    from mixfleet.runner.trainer.megatron_model import BuildOptions
    from mixfleet.runner.trainer.trainer import Trainer, TrainerConfig

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "trainer_step.json")
    args = ap.parse_args()
    spec = load_model_spec(args.model)
    t0 = time.perf_counter()
    trainer = Trainer(spec, TrainerConfig(build=BuildOptions(device="auto", seed=0)))
    build_s = time.perf_counter() - t0
    g = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(0, spec.vocab_size, (args.batch, args.seq), generator=g)}
    step_s = [trainer.train_step(batch, nll_loss)["step_s"] for _ in range(args.steps)]
    t0 = time.perf_counter()
    with torch.no_grad():
        trainer.forward_logits(batch["input_ids"])
    forward_s = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as tmp:
        export_s, save_s = [], []
        for i in range(3):
            t0 = time.perf_counter()
            trainer.export_hf(Path(tmp) / "hf", version=i)
            export_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            trainer.save_state(Path(tmp) / "state")
            save_s.append(time.perf_counter() - t0)
        export_bytes = sum(f.stat().st_size for f in (Path(tmp) / "hf").iterdir())
    tokens = args.batch * args.seq
    result = {
        "model": spec.name, "device": trainer.device, "batch": args.batch, "seq": args.seq, "tokens": tokens,
        "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(), "machine": platform.machine(),
        "build_s": round(build_s, 3), "train_step_s": [round(s, 3) for s in step_s],
        "train_step_s_min": round(min(step_s), 3), "train_tokens_per_s": round(tokens / min(step_s), 1),
        "forward_s": round(forward_s, 3), "export_hf_s": [round(s, 4) for s in export_s],
        "export_hf_bytes": export_bytes, "save_state_s": [round(s, 4) for s in save_s],
    }
    for k, v in result.items():
        print(f"{k:>20}: {v}")
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
