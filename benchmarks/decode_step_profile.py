"""Benchmark: one decode step of random-weight Qwen3-MoE-shaped layers on a GPU, bf16 and fp8, per batch and context.

Why: the cost model's decode step on a Hopper GPU comes from the roofline or from NVIDIA's profiled tables
(aiconfigurator); neither was ever held against a step this project timed itself. This script times the decode
step of a model spec's real shapes (data/models: hidden size, heads, KV heads, head dim, experts, top-k, expert
width, vocabulary) with random weights, on the GPU it is given, as a serving engine runs it:

- per layer: RMSNorm, QKV projection, per-head QK-norm, RoPE, the new token's K/V written into a bf16 cache of
  `context` tokens, attention over the cache (PyTorch SDPA; the query heads that share a KV head ride in the query
  length, so no KV is repeated), output projection, RMSNorm, the router (top-k, renormalized), the experts as two
  grouped GEMMs over the tokens sorted by expert (`torch._grouped_mm`; fp8: `torch._scaled_grouped_mm`, E4M3 with
  one scale per token and per output channel), SwiGLU, the weighted sum back per token;
- then the final norm and the output layer (logits for the whole vocabulary);
- bf16: every GEMM in bf16. fp8: every linear's weights in E4M3 with per-channel scales and the activations
  quantized per token, the dense linears through the engine's own FP8 GEMM (`scaled_mm_linear`,
  `torch._scaled_mm`); attention and the KV cache stay bf16 (SDPA takes no FP8 KV: an FP8-KV engine reads half
  the KV bytes, which this profile does not model);
- `--layers` distinct layers (default 4) are captured in one CUDA graph (as SGLang captures its decode batches)
  and replayed; the step is head + num_layers x (the measured layers' time / --layers). Each (batch, context)
  gets a fresh cache; combinations over `--max-tokens` cached tokens per layer are skipped.

Routing with random router weights spreads tokens about evenly over the experts, as a load-balanced model does.
Each figure is the median of `--repeats` timings of `--iters` graph replays (CUDA events). A check at a small size
compares the grouped-GEMM experts with a per-expert loop and the fp8 step with the bf16 one.

    python benchmarks/decode_step_profile.py --device cuda [--model qwen3-30b-a3b] [--precisions bf16,fp8]
        [--batches 1,8,32,128,256] [--contexts 1024,4096,16384,32768] [--layers 4] [--out PATH]
    python benchmarks/decode_step_profile.py --device cpu --model tiny-qwen3-moe --batches 1,4 --contexts 64
        (the same code on the CPU: eager, no graph; a smoke run, not a measurement)

Writes JSON (default benchmarks/results/decode_step_profile_<device>.json): one row per (precision, batch,
context) with the step's milliseconds, the layer and head parts, tokens/s, and the run's settings and GPU.
`--to-measurements JSON --gpu H200` makes data/measurements/mixfleet-h200-decode-profile.toml from it (metric
decode_step_ms, engine torch-reference), which `mixfleet validate-costmodel` holds the cost model against apart from
the published serving figures.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from mixfleet.runner.sampler.engine.model import quantize_rows_e4m3, rms_norm, scaled_mm_linear
from mixfleet.runner.sampler.engine.quant import quantize_fp8

RESULTS_DIR = Path(__file__).resolve().parent / "results"
PRECISIONS = ("bf16", "fp8")


# ---- weights ----------------------------------------------------------------------------------------------------
@dataclass
class Fp8Experts:
    """E4M3 expert weights for `torch._scaled_grouped_mm`: data [E, N, K] (so data.mT is the column-major [E, K, N]
    the kernel wants) with one float32 scale per expert and output channel, [E, N]."""

    data: torch.Tensor
    scale: torch.Tensor

    @classmethod
    def of(cls, w: torch.Tensor) -> Fp8Experts:
        """The engine's per-channel E4M3 (`quantize_fp8(..., "channel")`) over every expert's rows at once."""
        e, n, k = w.shape
        q = quantize_fp8(w.reshape(e * n, k), "channel")
        return cls(q.data.view(e, n, k), q.scale.view(e, n))

    def dequantize(self) -> torch.Tensor:
        return (self.data.float() * self.scale[..., None]).to(torch.bfloat16)


@dataclass
class Layer:
    attn_norm: torch.Tensor
    wqkv: torch.Tensor            # [(Hq + 2 Hkv) d, H]
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    wo: torch.Tensor              # [H, Hq d]
    ffn_norm: torch.Tensor
    router: torch.Tensor          # [E, H]
    gate_up: torch.Tensor         # [E, 2F, H]
    down: torch.Tensor            # [E, H, F]
    fp8: dict | None = None       # name -> Fp8Weight (dense) / Fp8Experts (experts)


def _randn(shape: tuple[int, ...], std: float, device: torch.device, gen: torch.Generator) -> torch.Tensor:
    return (torch.randn(shape, device=device, generator=gen, dtype=torch.float32) * std).to(torch.bfloat16)


def build_layer(spec, precision: str, device: torch.device, gen: torch.Generator) -> Layer:
    h, d = spec.hidden_size, spec.head_dim
    hq, hkv = spec.num_attention_heads, spec.num_kv_heads
    e, f = spec.moe.num_experts, spec.moe.expert_ffn_hidden_size
    ones = lambda n: torch.ones(n, device=device, dtype=torch.bfloat16)  # noqa: E731
    lay = Layer(attn_norm=ones(h), wqkv=_randn(((hq + 2 * hkv) * d, h), h ** -0.5, device, gen),
                q_norm=ones(d), k_norm=ones(d), wo=_randn((h, hq * d), (hq * d) ** -0.5, device, gen),
                ffn_norm=ones(h), router=_randn((e, h), h ** -0.5, device, gen),
                gate_up=_randn((e, 2 * f, h), h ** -0.5, device, gen), down=_randn((e, h, f), f ** -0.5, device, gen))
    if precision == "fp8":
        lay.fp8 = {"wqkv": quantize_fp8(lay.wqkv, "channel"), "wo": quantize_fp8(lay.wo, "channel"),
                   "gate_up": Fp8Experts.of(lay.gate_up), "down": Fp8Experts.of(lay.down)}
        # the bf16 copies are not needed by the fp8 step: keep the memory the GPU holds honest
        lay.wqkv = lay.wo = lay.gate_up = lay.down = torch.empty(0, device=device, dtype=torch.bfloat16)
    return lay


# ---- the step ---------------------------------------------------------------------------------------------------
def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return rms_norm(x, w.float(), eps)               # the engine's RMSNorm


def dense(x: torch.Tensor, lay: Layer, name: str) -> torch.Tensor:
    if lay.fp8 is not None:
        return scaled_mm_linear(x, lay.fp8[name])   # the engine's own FP8 GEMM
    return F.linear(x, getattr(lay, name))


def grouped(x: torch.Tensor, lay: Layer, name: str, offs: torch.Tensor) -> torch.Tensor:
    """Rows of x sorted by expert (group ends `offs`, int32) times each expert's weight: [M, N] bf16."""
    if lay.fp8 is not None:
        w: Fp8Experts = lay.fp8[name]
        xq, xs = quantize_rows_e4m3(x)                # the engine's per-token activations; xs [M, 1]
        if x.device.type == "cpu":   # no CPU kernel: the same operands group by group (the smoke run's path)
            return _scaled_grouped_mm_by_group(xq, w, xs, offs)
        return torch._scaled_grouped_mm(xq, w.data.mT, xs.view(-1), w.scale, offs=offs, out_dtype=torch.bfloat16)
    return torch._grouped_mm(x, getattr(lay, name).mT, offs=offs)


def _scaled_grouped_mm_by_group(xq: torch.Tensor, w: Fp8Experts, xs: torch.Tensor,
                                offs: torch.Tensor) -> torch.Tensor:
    out = torch.empty(xq.shape[0], w.data.shape[1], dtype=torch.bfloat16, device=xq.device)
    start = 0
    for g, end in enumerate(offs.tolist()):
        if end > start:
            out[start:end] = torch._scaled_mm(xq[start:end], w.data[g].T, scale_a=xs[start:end],
                                              scale_b=w.scale[g][None, :].contiguous(), out_dtype=torch.bfloat16)
        start = end
    return out


def experts_loop(x: torch.Tensor, lay: Layer, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The reference for the check: each token's experts one by one (dequantized weights for fp8)."""
    gu = lay.fp8["gate_up"].dequantize() if lay.fp8 else lay.gate_up
    dn = lay.fp8["down"].dequantize() if lay.fp8 else lay.down
    out = torch.zeros_like(x, dtype=torch.float32)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            g, u = (x[t].float() @ gu[ids[t, j]].float().T).chunk(2)
            out[t] += weights[t, j] * ((F.silu(g) * u) @ dn[ids[t, j]].float().T)
    return out.to(x.dtype)


def moe(x: torch.Tensor, lay: Layer, topk: int, norm_topk: bool, *,
        routed: list | None = None) -> torch.Tensor:
    b, e = x.shape[0], lay.router.shape[0]
    logits = F.linear(x, lay.router).float()
    probs = logits.softmax(-1)
    w, ids = probs.topk(topk, dim=-1)
    if norm_topk:
        w = w / w.sum(-1, keepdim=True)
    if routed is not None:
        routed.append((ids, w))
    flat = ids.reshape(-1)
    order = flat.argsort(stable=True)
    token = torch.arange(b, device=x.device).repeat_interleave(topk)[order]
    counts = torch.zeros(e, device=x.device, dtype=torch.int32).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = counts.cumsum(0, dtype=torch.int32)
    xs = x[token]
    g, u = grouped(xs, lay, "gate_up", offs).chunk(2, dim=-1)
    y = grouped((F.silu(g.float()) * u.float()).to(torch.bfloat16).contiguous(), lay, "down", offs)
    y = y.float() * w.reshape(-1)[order, None]
    return torch.zeros(b, x.shape[1], device=x.device, dtype=torch.float32).index_add_(0, token, y).to(x.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    xf = x.float()
    return (xf * cos + torch.cat([-xf[..., half:], xf[..., :half]], -1) * sin).to(x.dtype)


def attention_block(x: torch.Tensor, lay: Layer, kv: tuple[torch.Tensor, torch.Tensor], spec, cos: torch.Tensor,
                    sin: torch.Tensor) -> torch.Tensor:
    """x + the attention half of a layer (norm, QKV, QK-norm, RoPE, cache write, SDPA, output projection)."""
    b = x.shape[0]
    d, hq, hkv = spec.head_dim, spec.num_attention_heads, spec.num_kv_heads
    eps = spec.norm_eps
    qkv = dense(rms(x, lay.attn_norm, eps), lay, "wqkv")
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q = rope(rms(q.reshape(b, hq, d), lay.q_norm, eps), cos, sin)
    k = rope(rms(k.reshape(b, hkv, d), lay.k_norm, eps), cos, sin)
    kc, vc = kv                                         # [B, Hkv, L, d]: the new token is the last position
    kc[:, :, -1] = k
    vc[:, :, -1] = v.reshape(b, hkv, d)
    # the Hq / Hkv query heads of one KV head as that head's query rows: GQA without repeating the cache
    qg = q.reshape(b, hkv, hq // hkv, d)
    att = F.scaled_dot_product_attention(qg, kc, vc)   # [B, Hkv, Hq/Hkv, d]
    return x + dense(att.reshape(b, hq * d), lay, "wo")


def moe_block(x: torch.Tensor, lay: Layer, spec, routed: list | None = None) -> torch.Tensor:
    """x + the MoE half of a layer (norm, router, experts)."""
    return x + moe(rms(x, lay.ffn_norm, spec.norm_eps), lay, spec.moe.active_experts, spec.moe.norm_topk_prob,
                   routed=routed)


def layer_step(x: torch.Tensor, lay: Layer, kv: tuple[torch.Tensor, torch.Tensor], spec, cos: torch.Tensor,
               sin: torch.Tensor, routed: list | None = None) -> torch.Tensor:
    return moe_block(attention_block(x, lay, kv, spec, cos, sin), lay, spec, routed)


# ---- timing -----------------------------------------------------------------------------------------------------
def _timed(fn: Callable[[], object], device: torch.device, iters: int, repeats: int,
           graph: bool) -> tuple[float, bool, str]:
    """Median milliseconds per call of fn: CUDA-graph replays timed with events (eager where capture fails or on
    the CPU). Returns (ms, graphed, why-not-graphed)."""
    if device.type != "cuda":
        fn()
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            for _ in range(iters):
                fn()
            times.append((time.perf_counter() - t) * 1e3 / iters)
        return statistics.median(times), False, "cpu"
    why = ""
    call: Callable[[], object] = fn
    if graph:
        try:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(3):
                    fn()
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
            call = g.replay
        except Exception as e:  # noqa: BLE001 - recorded with the row; the eager timing stands in
            why = _short(e)
            torch.cuda.synchronize()
            call = fn
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            call()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / iters)
    return statistics.median(times), call is not fn, why


def _rope_at(pos: int, spec, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    d = spec.head_dim
    inv = 1.0 / (spec.rope_theta ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d))
    ang = pos * inv
    ang = torch.cat([ang, ang])
    return ang.cos(), ang.sin()


def check(spec, device: torch.device, seed: int) -> dict:
    """At batch 4 and 32 cached tokens: grouped experts vs a per-expert loop (each precision), fp8 step vs bf16."""
    gen = torch.Generator(device=device).manual_seed(seed)
    out: dict = {}
    lay_bf = build_layer(spec, "bf16", device, gen)
    lay_f8 = Layer(**{**lay_bf.__dict__})
    lay_f8.fp8 = {"wqkv": quantize_fp8(lay_bf.wqkv, "channel"), "wo": quantize_fp8(lay_bf.wo, "channel"),
                  "gate_up": Fp8Experts.of(lay_bf.gate_up), "down": Fp8Experts.of(lay_bf.down)}
    x = _randn((4, spec.hidden_size), 1.0, device, gen)
    for name, lay in (("bf16", lay_bf), ("fp8", lay_f8)):
        try:
            routed: list = []
            y = moe(x, lay, spec.moe.active_experts, spec.moe.norm_topk_prob, routed=routed)
            ref = experts_loop(x, lay, *routed[0])
            out[f"experts_grouped_vs_loop_rel_err_{name}"] = float((y.float() - ref.float()).norm()
                                                                   / ref.float().norm())
        except Exception as e:  # noqa: BLE001 - reported; the other precision is still checked
            out[f"experts_grouped_vs_loop_error_{name}"] = _short(e)
    try:
        cos, sin = _rope_at(31, spec, device)
        kv = [_randn((4, spec.num_kv_heads, 32, spec.head_dim), 1.0, device, gen) for _ in range(2)]
        a = layer_step(x, lay_bf, (kv[0].clone(), kv[1].clone()), spec, cos, sin)
        b = layer_step(x, lay_f8, (kv[0].clone(), kv[1].clone()), spec, cos, sin)
        # relative to what the layer adds to its input (the residual would hide the error)
        out["fp8_vs_bf16_layer_rel_err"] = float((b.float() - a.float()).norm() / (a.float() - x.float()).norm())
    except Exception as e:  # noqa: BLE001
        out["fp8_vs_bf16_layer_error"] = _short(e)
    return out


def _short(e: BaseException) -> str:
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"


def time_step(spec, layers: list[Layer], head_lay: Layer, b: int, ctx: int, device: torch.device,
              gen: torch.Generator, args: argparse.Namespace) -> dict:
    """One (batch, context): a fresh bf16 cache per measured layer, the layers' step and the head's timed apart."""
    x0 = _randn((b, spec.hidden_size), 1.0, device, gen)
    caches = [tuple(_randn((b, spec.num_kv_heads, ctx, spec.head_dim), 1.0, device, gen) for _ in range(2))
              for _ in layers]
    cos, sin = _rope_at(ctx - 1, spec, device)
    final_norm = torch.ones(spec.hidden_size, device=device, dtype=torch.bfloat16)

    def step_layers() -> torch.Tensor:
        x = x0
        for lay, kv in zip(layers, caches, strict=True):
            x = layer_step(x, lay, kv, spec, cos, sin)
        return x

    def step_head() -> torch.Tensor:
        return dense(rms(x0, final_norm, spec.norm_eps), head_lay, "wqkv")

    def step_attention() -> None:
        for lay, kv in zip(layers, caches, strict=True):
            attention_block(x0, lay, kv, spec, cos, sin)

    def step_moe() -> None:
        for lay in layers:
            moe_block(x0, lay, spec)

    graph = not args.eager
    ms_layers, g1, why1 = _timed(step_layers, device, args.iters, args.repeats, graph)
    ms_head, g2, why2 = _timed(step_head, device, args.iters, args.repeats, graph)
    ms_attn, g3, why3 = _timed(step_attention, device, args.iters, args.repeats, graph)
    ms_moe, g4, why4 = _timed(step_moe, device, args.iters, args.repeats, graph)
    n = len(layers)
    per_layer = ms_layers / n
    step = ms_head + spec.num_layers * per_layer
    return {"step_ms": step, "per_layer_ms": per_layer, "head_ms": ms_head, "tokens_per_s": b / step * 1e3,
            # the two halves of a layer timed alone (their sum is about per_layer_ms)
            "attention_ms_per_layer": ms_attn / n, "moe_ms_per_layer": ms_moe / n,
            "cuda_graph": bool(g1 and g2 and g3 and g4), "graph_error": why1 or why2 or why3 or why4 or None}


def profile(args: argparse.Namespace) -> dict:
    from mixfleet.costmodel.specs.model import load_model_spec

    spec = load_model_spec(args.model)
    if spec.moe is None:
        raise SystemExit(f"--model {args.model!r}: not a MoE spec (this profile times Qwen3-MoE-shaped layers)")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    precisions = args.precisions.split(",")
    for p in precisions:
        if p not in PRECISIONS:
            raise SystemExit(f"--precisions: {p!r}; allowed: {', '.join(PRECISIONS)}")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or "cpu")
    result = {"benchmark": "decode_step_profile", "model": spec.name, "hf_id": getattr(spec, "hf_id", None),
              "shapes": {"num_layers": spec.num_layers, "hidden": spec.hidden_size,
                         "heads": spec.num_attention_heads, "kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim,
                         "experts": spec.moe.num_experts, "topk": spec.moe.active_experts,
                         "expert_ffn": spec.moe.expert_ffn_hidden_size, "vocab": spec.vocab_size},
              "device": str(device), "device_name": name, "torch": torch.__version__,
              "cuda": torch.version.cuda, "layers_measured": args.layers, "iters": args.iters,
              "repeats": args.repeats, "kv_cache_dtype": "bf16", "seed": args.seed,
              "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "rows": [], "skipped": []}
    try:
        result["check"] = check(spec, device, args.seed)
    except Exception as e:  # noqa: BLE001 - a failed check is reported, the timings still run
        result["check"] = {"error": _short(e)}
    print("check:", result["check"], flush=True)
    out_path = Path(args.out)
    for precision in precisions:
        gen = torch.Generator(device=device).manual_seed(args.seed)
        layers = [build_layer(spec, precision, device, gen) for _ in range(args.layers)]
        head = _randn((spec.vocab_size, spec.hidden_size), spec.hidden_size ** -0.5, device, gen)
        head_lay = Layer(**{k: torch.empty(0) for k in Layer.__dataclass_fields__ if k != "fp8"})
        head_lay.wqkv = head
        if precision == "fp8":
            head_lay.fp8 = {"wqkv": quantize_fp8(head, "channel")}
        for b in batches:
            for ctx in contexts:
                if b * ctx > args.max_tokens:
                    result["skipped"].append({"precision": precision, "batch": b, "context": ctx,
                                              "why": f"{b * ctx} cached tokens per layer > --max-tokens"})
                    continue
                row = {"precision": precision, "batch": b, "context": ctx}
                try:
                    row.update(time_step(spec, layers, head_lay, b, ctx, device, gen, args))
                    print(f"{precision:>5} batch {b:>4} ctx {ctx:>6}: step {row['step_ms']:8.3f} ms  (layer "
                          f"{row['per_layer_ms']:.4f} ms x {spec.num_layers} [attn {row['attention_ms_per_layer']:.4f}"
                          f" moe {row['moe_ms_per_layer']:.4f}], head {row['head_ms']:.3f} ms)  "
                          f"{row['tokens_per_s']:10.0f} tok/s{'' if row['cuda_graph'] else '  [eager]'}", flush=True)
                except Exception as e:  # noqa: BLE001 - one failed size is a row with its error, not a lost run
                    row["error"] = _short(e)
                    print(f"{precision} batch {b} ctx {ctx}: {row['error']}", flush=True)
                result["rows"].append(row)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                out_path.parent.mkdir(parents=True, exist_ok=True)
                out_path.write_text(json.dumps(result, indent=2) + "\n")     # after every row: a cut run keeps them
        layers.clear()
        if device.type == "cuda":
            result.setdefault("peak_gib", {})[precision] = torch.cuda.max_memory_allocated() / 2 ** 30
            torch.cuda.reset_peak_memory_stats()
            torch.cuda.empty_cache()
    out_path.write_text(json.dumps(result, indent=2) + "\n")
    return result


def to_measurements(result: dict, gpu: str) -> str:
    """The profile as a data/measurements file: one tpot-like row per (precision, batch, context), metric
    decode_step_ms, engine torch-reference (this project's reference kernels, not a serving engine: the cost model's
    fit and its published-figure summaries leave such rows out; `mixfleet validate-costmodel` reports them apart)."""
    import tomli_w

    date = result["time_utc"][:10]
    rows = []
    for r in result["rows"]:
        if "error" in r or not r.get("cuda_graph"):
            continue
        rows.append({"section": "decode step, one GPU, CUDA graph", "model": result["model"],
                     "hf_id": result.get("hf_id") or "", "gpu": gpu, "layout": "TP1", "gpus": 1, "tp": 1,
                     "precision": r["precision"], "precision_source": f"{r['precision']} (random weights)",
                     "kv_dtype": result["kv_cache_dtype"], "engine": "torch-reference",
                     "engine_version": f"torch {result['torch']}", "isl": int(r["context"]), "osl": 1,
                     "concurrency": int(r["batch"]), "metric": "decode_step_ms", "value": round(r["step_ms"], 4),
                     "note": f"per layer {r['per_layer_ms']:.4f} ms (attention {r['attention_ms_per_layer']:.4f}, "
                             f"MoE {r['moe_ms_per_layer']:.4f}) x {result['shapes']['num_layers']}, "
                             f"output layer {r['head_ms']:.4f} ms"})
    doc = {"schema": 1, "source": {
        "id": f"mixfleet-{gpu.lower()}-decode-profile",
        "publisher": "mixfleet (measured by this project)",
        "title": f"Decode step of {result['model']}-shaped random-weight layers on one {result['device_name']}",
        "url": "benchmarks/decode_step_profile.py (this repository)", "version": f"torch {result['torch']}, "
               f"CUDA {result['cuda']}", "date": date,
        "method": ("PyTorch reference kernels in one CUDA graph: SDPA attention over a bf16 KV cache of `isl` tokens "
                   "(the step's context), grouped-GEMM experts (torch._grouped_mm / _scaled_grouped_mm, E4M3 per-token"
                   " x per-channel for fp8), the engine's scaled_mm_linear for fp8 dense layers; "
                   f"{result['layers_measured']} distinct layers timed, scaled to the model's "
                   f"{result['shapes']['num_layers']}, plus the output layer; median of {result['repeats']} x "
                   f"{result['iters']} replays. No fused MoE or FlashInfer kernels: an upper bound on what a serving "
                   "engine's step costs, and the shape of its growth with batch and context."),
        "concurrency": "the batch of the decode step (every sequence at the same context)",
        "kv_note": "bf16 KV (SDPA takes no FP8 KV)"}, "rows": rows}
    return ("# Measured by this project (benchmarks/decode_step_profile.py on a lent GPU; the JSON it wrote is\n"
            f"# benchmarks/results/decode_step_profile_{gpu.lower()}.json). Made with:\n"
            f"#   python benchmarks/decode_step_profile.py --to-measurements "
            f"benchmarks/results/decode_step_profile_{gpu.lower()}.json --gpu {gpu}\n" + tomli_w.dumps(doc))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen3-30b-a3b", help="a MoE model spec (data/models)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--precisions", default="bf16,fp8")
    ap.add_argument("--batches", default="1,8,32,128,256")
    ap.add_argument("--contexts", default="1024,4096,16384,32768")
    ap.add_argument("--layers", type=int, default=4, help="distinct layers measured (the step scales them)")
    ap.add_argument("--max-tokens", type=int, default=1 << 20, help="largest batch x context cached per layer")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eager", action="store_true", help="no CUDA graph")
    ap.add_argument("--out", default=None)
    ap.add_argument("--to-measurements", metavar="JSON", default=None,
                    help="write a profile's JSON as data/measurements/mixfleet-<gpu>-decode-profile.toml (or --out)")
    ap.add_argument("--gpu", default=None, help="with --to-measurements: the GPU's catalog name (e.g. H200)")
    args = ap.parse_args()
    if args.to_measurements:
        if not args.gpu:
            ap.error("--to-measurements needs --gpu (the catalog's accelerator name, e.g. H200)")
        text = to_measurements(json.loads(Path(args.to_measurements).read_text()), args.gpu)
        out = Path(args.out or Path(__file__).resolve().parents[1] / "data" / "measurements"
                   / f"mixfleet-{args.gpu.lower()}-decode-profile.toml")
        out.write_text(text)
        print(f"wrote {out}")
        return
    if args.layers < 1 or args.iters < 1 or args.repeats < 1:
        ap.error("--layers, --iters and --repeats must be >= 1")
    if args.out is None:
        args.out = str(RESULTS_DIR / f"decode_step_profile_{args.device.split(':')[0]}.json")
    profile(args)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
