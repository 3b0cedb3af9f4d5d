#!/usr/bin/env bash
# The project's GPU checks in one run, for a lent CUDA machine (never CI): run from the repository root.
#   1. real FP8 GEMMs (torch._scaled_mm) in the embedded engine: its CUDA tests and engine_throughput rows;
#   2. benchmarks/loss_memory.py on the GPU at T = 65,536 tokens, V = 151,936 (Qwen3's vocabulary), H = 2048;
#   3. benchmarks/decode_step_profile.py: a decode step of Qwen3-30B-A3B-shaped random-weight layers, bf16 / fp8.
# Each part has its own time limit, so one that hangs does not cost the others. Results go to $OUT (or
# benchmarks/results/gpu/); copy the JSON into benchmarks/results/ and make data/measurements rows from the profile
# (docs/costmodel.md, "Measured by this project"). The loss runs with expandable segments: without them the naive
# loss at this size failed for fragmentation (37 GiB reserved but unallocated) before the memory ran out.
# mixfleet is not installed there: the checkout's folders are linked as the `mixfleet` namespace package (the
# image's python3 holds torch; the checks need nothing else of the project's dependencies).
set -u
cd "$(dirname "$0")/../.."
OUTDIR=${OUT:-benchmarks/results/gpu}
mkdir -p "$OUTDIR"
PKG=$(mktemp -d)
mkdir -p "$PKG/mixfleet"
for d in costmodel policies twin runner studies ui data; do ln -s "$PWD/$d" "$PKG/mixfleet/$d"; done
export PYTHONPATH="$PKG" PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
log() { echo "== $(date -u +%H:%M:%S) $*"; }
{
  log "machine"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  python3 -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(), torch.cuda.get_device_capability())"
  log "1a. engine FP8 tests (tests/test_engine.py -k fp8)"
  timeout 120 python3 -m pytest -p no:cacheprovider -q tests/test_engine.py -k fp8 -rA 2>&1 | tail -25
  log "1b. engine throughput on cuda, tiny-qwen3-moe: bf16, fp8 (dequantized), fp8 + _scaled_mm"
  timeout 120 python3 benchmarks/engine_throughput.py --model tiny-qwen3-moe --device cuda --precisions bf16,fp8 \
    --fp8-scaled-mm --batches 1,8,32 --new-tokens 32 --out "$OUTDIR/engine_throughput_cuda_tiny-qwen3-moe.json"
  log "3. decode-step profile, qwen3-30b-a3b shapes"
  timeout 180 python3 benchmarks/decode_step_profile.py --device cuda --model qwen3-30b-a3b \
    --out "$OUTDIR/decode_step_profile_cuda.json"
  log "2. loss memory on cuda, T=65536 V=151936 H=2048 bf16"
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 150 python3 benchmarks/loss_memory.py --device cuda --T 65536 --V 151936 --H 2048 --dtype bf16 \
    --repeats 3 --out "$OUTDIR/loss_memory_hidden_cuda_bf16_65536x151936.json"
  log "done"
} 2>&1 | tee "$OUTDIR/h200_checks.log"
