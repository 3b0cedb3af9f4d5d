"""The engine's transformer: loads a Hugging Face layout checkpoint in one precision and runs the forward.

The forward is the one `runner/checkpoint/hf_checkpoint.py` defines for its three layouts (mixfleet, qwen3,
qwen3_moe; the trainer implements the same, HF transformers' Qwen3 classes are the independent reference):
embeddings (+ learned positions), per layer RMSNorm -> q/k/v (+ per-head QK RMSNorm) -> RoPE -> causal GQA
attention -> residual, RMSNorm -> SwiGLU MLP or top-k routed MoE -> residual; final RMSNorm; lm_head. Two
entry points share it: `prefill_many` (new requests, several tokens each, causal) and `decode` (one token for
each of a batch of requests of different lengths, padded and masked), both reading and writing a `KVPool`.
Both can also hand back the experts each token was routed to in each layer (`routing=`), the record SGLang
returns as `meta_info.routed_experts`.

Numerics: the linear weights of each layer (attention, dense MLP, and every expert's gate / up / down, each
expert's matrix quantized on its own) are quantized to the precision (quant.py) and stored *dequantized* in
the kernel dtype (fp32 or bf16); embeddings, norms, the MoE router and lm_head are kept in bf16 (fp32 for the
fp32 reference), as serving stacks do. Activations run in the kernel dtype; RMSNorm statistics, softmax (the
router's too: top-k is taken on fp32 probabilities) and the logits are fp32. `Weights` is immutable: a weight
update builds a new one and the engine swaps the reference between steps.

Emulated kernel error (`weight_noise`, default 0 = off): the mismatch knob of the ablation study
(docs/ablation/). Each linear weight (router and experts included) and lm_head, after quantization, is
multiplied by (1 + s * e), e ~ N(0, 1) drawn from a generator seeded by (`noise_seed`, the tensor's name): a
fixed pattern, the same at every weight load, so, like a quantization error, it biases the sampler the same
way at every version. It makes a tiny model's sampler-trainer mismatch as large as a study needs.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from mixfleet.costmodel.specs.formats import formats
from mixfleet.runner.checkpoint.hf_checkpoint import HFConfig, load_checkpoint
from mixfleet.runner.sampler.engine.kvcache import KVPool
from mixfleet.runner.sampler.engine.quant import FP8_SCALINGS, WEIGHT_PRECISIONS, Fp8Weight, fake_quantize, quantize_fp8

_TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
KERNEL_DTYPES = {k: _TORCH_DTYPES[k] for k in formats().kernels}   # data/precisions.toml: kernel = true
_ATTN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
_MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
_LINEARS = _ATTN + _MLP
_EXPERT = ("gate_proj", "up_proj", "down_proj")
_ARCH_FIELDS = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings",
                "position_embedding_type", "tie_word_embeddings", "rope_theta", "rms_norm_eps", "num_experts",
                "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob")


@dataclass(frozen=True)
class LayerWeights:
    ln1: torch.Tensor                # [hidden] fp32 (values rounded to the storage dtype)
    ln2: torch.Tensor
    wqkv: torch.Tensor               # [(heads + 2 kv_heads) * head_dim, hidden] kernel dtype, dequantized
    wo: torch.Tensor                 # [hidden, heads * head_dim]
    w_gate_up: torch.Tensor | None   # [2 ffn, hidden] (dense MLP)
    w_down: torch.Tensor | None      # [hidden, ffn]
    q_norm: torch.Tensor | None = None        # [head_dim] fp32 (QK-norm layouts)
    k_norm: torch.Tensor | None = None
    router: torch.Tensor | None = None        # [experts, hidden] kernel dtype, bf16 values (MoE)
    experts_gate_up: torch.Tensor | None = None  # [experts, 2 moe_ffn, hidden] kernel dtype, dequantized
    experts_down: torch.Tensor | None = None     # [experts, hidden, moe_ffn]
    fp8: dict[str, Fp8Weight] | None = None   # real FP8 operands (only with fp8_scaled_mm)
    fp8_experts: tuple[tuple[Fp8Weight, Fp8Weight], ...] | None = None   # per expert (gate_up, down)


@dataclass(frozen=True)
class Weights:
    """One loaded, quantized weight version (immutable; shared by all steps that use it)."""

    cfg: HFConfig
    version: str
    precision: str
    kernel: str
    embed: torch.Tensor              # [vocab, hidden] fp32 values of the storage dtype
    pos: torch.Tensor | None         # [max_context, hidden] (learned_absolute only)
    layers: tuple[LayerWeights, ...]
    norm: torch.Tensor               # [hidden] fp32
    lm_head: torch.Tensor            # [vocab, hidden] kernel dtype
    rope_cos: torch.Tensor | None    # [max_context, head_dim] fp32 (rope only)
    rope_sin: torch.Tensor | None
    fp8_scaled_mm: bool = False

    @property
    def dtype(self) -> torch.dtype:
        return KERNEL_DTYPES[self.kernel]


def same_architecture(a: HFConfig, b: HFConfig) -> str | None:
    """None if the two configs define the same architecture, else a message naming the first difference."""
    for name in _ARCH_FIELDS:
        if getattr(a, name) != getattr(b, name):
            return f"{name} is {getattr(b, name)!r}, the serving model has {getattr(a, name)!r}"
    return None


def perturb(w: torch.Tensor, rel_std: float, seed: int, name: str) -> torch.Tensor:
    """`w * (1 + rel_std * e)`, e ~ N(0, 1) fixed by (seed, name) (emulated kernel error; see the module doc)."""
    if rel_std <= 0.0:
        return w
    gen = torch.Generator().manual_seed((int(seed) * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    e = torch.randn(w.shape, generator=gen, dtype=torch.float32).to(w.device)
    return (w.to(torch.float32) * (1.0 + rel_std * e)).to(w.dtype)


def build_weights(cfg: HFConfig, tensors: dict[str, torch.Tensor], *, precision: str, kernel: str,
                  version: str | None = None, fp8_scaling: str = "block", fp8_scaled_mm: bool = False,
                  device: torch.device | str = "cpu", weight_noise: float = 0.0, noise_seed: int = 0) -> Weights:
    """Quantize a checkpoint's tensors to `precision`, dequantize into the kernel dtype (then, if
    `weight_noise` > 0, apply the emulated kernel error of the module doc)."""
    if not (isinstance(weight_noise, int | float) and 0.0 <= weight_noise < 10.0):
        raise ValueError(f"weight_noise {weight_noise!r}: allowed a number in [0, 10)")
    if weight_noise > 0 and fp8_scaled_mm:
        raise ValueError("weight_noise needs fp8_scaled_mm off (the FP8 operands could not carry it)")
    if precision not in WEIGHT_PRECISIONS:
        raise ValueError(f"precision {precision!r}: allowed {', '.join(WEIGHT_PRECISIONS)}")
    if kernel not in KERNEL_DTYPES:
        raise ValueError(f"kernel {kernel!r}: allowed {', '.join(KERNEL_DTYPES)}")
    if fp8_scaling not in FP8_SCALINGS:
        raise ValueError(f"fp8_scaling {fp8_scaling!r}: allowed {', '.join(FP8_SCALINGS)}")
    if fp8_scaled_mm and precision != "fp8":
        raise ValueError(f"fp8_scaled_mm needs precision 'fp8', got {precision!r}")
    kdt = KERNEL_DTYPES[kernel]
    store = torch.float32 if precision == "fp32" else torch.bfloat16   # non-linear weights

    def plain(name: str) -> torch.Tensor:
        return tensors[name].to(torch.float32).to(store).to(torch.float32).to(device)

    def quant(name: str) -> torch.Tensor:
        return perturb(fake_quantize(tensors[name].to(torch.float32), precision, fp8_scaling=fp8_scaling),
                       weight_noise, noise_seed, name)

    linears = _ATTN if cfg.is_moe else _LINEARS
    layers = []
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        fp8 = fp8_experts = None
        if fp8_scaled_mm:        # per-channel FP8 operands; the dequantized copies hold the same values
            fp8 = {n: quantize_fp8(tensors[p + n + ".weight"].to(torch.float32), "channel") for n in linears}
            q = {n: w.dequantize() for n, w in fp8.items()}
            fp8 = {n: Fp8Weight(w.data.to(device), w.scale.to(device), w.scaling) for n, w in fp8.items()}
            fp8["qkv"] = _cat_fp8([fp8[n] for n in _ATTN[:3]])
            if not cfg.is_moe:
                fp8["gate_up"] = _cat_fp8([fp8[n] for n in _MLP[:2]])
        else:
            q = {n: quant(p + n + ".weight") for n in linears}
        moe: dict[str, torch.Tensor | None] = {"router": None, "experts_gate_up": None, "experts_down": None}
        if cfg.is_moe:
            e_names = [{n: f"{p}mlp.experts.{e}.{n}.weight" for n in _EXPERT} for e in range(cfg.num_experts)]
            if fp8_scaled_mm:
                per = [{n: quantize_fp8(tensors[x[n]].to(torch.float32), "channel") for n in _EXPERT} for x in e_names]
                per = [{n: Fp8Weight(w.data.to(device), w.scale.to(device), w.scaling) for n, w in x.items()}
                       for x in per]
                fp8_experts = tuple((_cat_fp8([x["gate_proj"], x["up_proj"]]), x["down_proj"]) for x in per)
                deq = [{n: w.dequantize() for n, w in x.items()} for x in per]
            else:
                deq = [{n: quant(x[n]) for n in _EXPERT} for x in e_names]
            gate_up = [torch.cat([x["gate_proj"], x["up_proj"]]) for x in deq]
            moe["experts_gate_up"] = torch.stack(gate_up).to(device, kdt)
            moe["experts_down"] = torch.stack([x["down_proj"] for x in deq]).to(device, kdt)
            moe["router"] = perturb(plain(p + "mlp.gate.weight"), weight_noise, noise_seed, p + "mlp.gate").to(kdt)
        layers.append(LayerWeights(
            ln1=plain(p + "input_layernorm.weight"), ln2=plain(p + "post_attention_layernorm.weight"),
            wqkv=torch.cat([q["self_attn.q_proj"], q["self_attn.k_proj"], q["self_attn.v_proj"]]).to(device, kdt),
            wo=q["self_attn.o_proj"].to(device, kdt),
            w_gate_up=None if cfg.is_moe else torch.cat([q["mlp.gate_proj"], q["mlp.up_proj"]]).to(device, kdt),
            w_down=None if cfg.is_moe else q["mlp.down_proj"].to(device, kdt),
            q_norm=plain(p + "self_attn.q_norm.weight") if cfg.qk_norm else None,
            k_norm=plain(p + "self_attn.k_norm.weight") if cfg.qk_norm else None,
            fp8=fp8, fp8_experts=fp8_experts, **moe))
    head_name = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    cos = sin = None
    if cfg.position_embedding_type == "rope":
        d = cfg.head_dim
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        ang = torch.arange(cfg.max_position_embeddings, dtype=torch.float64)[:, None] * inv[None, :]
        ang = torch.cat([ang, ang], dim=-1)
        cos, sin = ang.cos().to(torch.float32).to(device), ang.sin().to(torch.float32).to(device)
    return Weights(
        cfg=cfg, version=str(cfg.weight_version if version is None else version), precision=precision,
        kernel=kernel, embed=plain("model.embed_tokens.weight"),
        pos=plain("model.embed_positions.weight") if cfg.position_embedding_type == "learned_absolute" else None,
        layers=tuple(layers), norm=plain("model.norm.weight"),
        lm_head=perturb(plain(head_name), weight_noise, noise_seed, head_name).to(kdt),
        rope_cos=cos, rope_sin=sin, fp8_scaled_mm=fp8_scaled_mm)


def _cat_fp8(parts: list[Fp8Weight]) -> Fp8Weight:
    """Per-channel FP8 weights stacked along the output dim (one GEMM for q|k|v or gate|up)."""
    return Fp8Weight(torch.cat([w.data for w in parts]), torch.cat([w.scale for w in parts]), "channel")


def load_weights(path: str | Path, *, precision: str, kernel: str, version: str | None = None,
                 fp8_scaling: str = "block", fp8_scaled_mm: bool = False,
                 device: torch.device | str = "cpu", weight_noise: float = 0.0, noise_seed: int = 0) -> Weights:
    """Read a checkpoint folder and build its `Weights` (version: the argument, else config's)."""
    cfg, tensors = load_checkpoint(path)
    return build_weights(cfg, tensors, precision=precision, kernel=kernel, version=version,
                         fp8_scaling=fp8_scaling, fp8_scaled_mm=fp8_scaled_mm, device=device,
                         weight_noise=weight_noise, noise_seed=noise_seed)


# ---- building blocks ---------------------------------------------------------------------------
def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.to(torch.float32)
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w).to(x.dtype)


_SCALED_MM_SUPPORT: dict[str, str] = {}


def scaled_mm_unsupported(device: torch.device | str) -> str:
    """Why this torch cannot run `scaled_mm_linear` on `device` ("" when it can): a row-wise-scaled E4M3 GEMM is
    tried once per device type. torch 2.11's CPU kernel takes per-tensor scales only (seen on the H200 machine's
    image, 2026-12-04); 2.13's takes row-wise ones; on CUDA it needs FP8 tensor cores (Ada / Hopper or newer)."""
    dev = torch.device(device)
    key = f"{dev.type}:{dev.index}"
    if key not in _SCALED_MM_SUPPORT:
        try:
            a = torch.ones(16, 16, device=dev).to(torch.float8_e4m3fn)
            s = torch.ones(16, 1, device=dev)
            torch._scaled_mm(a, a.t(), scale_a=s, scale_b=s.t().contiguous(), out_dtype=torch.bfloat16)
            _SCALED_MM_SUPPORT[key] = ""
        except (RuntimeError, NotImplementedError, TypeError) as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            _SCALED_MM_SUPPORT[key] = f"torch {torch.__version__} has no row-wise-scaled FP8 GEMM on {dev}: {first}"
    return _SCALED_MM_SUPPORT[key]


def quantize_rows_e4m3(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations as a real FP8 GEMM takes them: E4M3 with one float32 scale per row (token), [rows, 1]."""
    xf = x.to(torch.float32)
    xs = (xf.abs().amax(dim=1, keepdim=True) / 448.0).clamp_min(1e-12)
    return (xf / xs).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), xs


def scaled_mm_linear(x: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
    """A real FP8 GEMM (`torch._scaled_mm`: CUDA Hopper+, or CPU): activations quantized to E4M3 with
    one scale per token, times the E4M3 weight with one scale per output channel; bf16 out."""
    m = x.shape[0]
    pad = (-m) % 16
    xf = x.to(torch.float32)
    if pad:
        xf = F.pad(xf, (0, 0, 0, pad))
    xq, xs = quantize_rows_e4m3(xf)
    out = torch._scaled_mm(xq, w.data.t(), scale_a=xs, scale_b=w.scale.t().contiguous(), out_dtype=torch.bfloat16)
    return out[:m].to(x.dtype)


def _linear(x: torch.Tensor, w: torch.Tensor, fp8: Fp8Weight | None) -> torch.Tensor:
    if fp8 is not None:
        return scaled_mm_linear(x, fp8)
    return F.linear(x, w)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE. x [n, heads, d]; cos/sin [n, d] (fp32)."""
    half = x.shape[-1] // 2
    xf = x.to(torch.float32)
    rot = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos[:, None, :] + rot * sin[:, None, :]).to(x.dtype)


def _embed(w: Weights, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    x = w.embed[ids]
    if w.pos is not None:
        x = x + w.pos[positions]
    return x.to(w.dtype)


def _qkv(w: Weights, lw: LayerWeights, x: torch.Tensor, positions: torch.Tensor):
    cfg = w.cfg
    h, kvh, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    n = rms_norm(x, lw.ln1, cfg.rms_norm_eps)
    qkv = _linear(n, lw.wqkv, lw.fp8["qkv"] if lw.fp8 else None)
    q, k, v = qkv.split([h * d, kvh * d, kvh * d], dim=-1)
    q, k, v = q.reshape(-1, h, d), k.reshape(-1, kvh, d), v.reshape(-1, kvh, d)
    if lw.q_norm is not None:            # Qwen3: RMSNorm over head_dim of every head, before RoPE
        q, k = rms_norm(q, lw.q_norm, cfg.rms_norm_eps), rms_norm(k, lw.k_norm, cfg.rms_norm_eps)
    if w.rope_cos is not None:
        cos, sin = w.rope_cos[positions], w.rope_sin[positions]
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
    return q, k, v


def _moe(w: Weights, lw: LayerWeights, n: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routed SwiGLU experts over tokens n [t, hidden]: (output [t, hidden], experts [t, k] int32).
    Router probabilities are fp32 softmax; top-k by torch.topk; weights renormalized when norm_topk_prob;
    expert outputs summed in fp32 in ascending expert order."""
    cfg = w.cfg
    probs = torch.softmax(F.linear(n, lw.router).to(torch.float32), dim=-1)
    top_w, top_i = torch.topk(probs, cfg.num_experts_per_tok, dim=-1)
    if cfg.norm_topk_prob:
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
    out = torch.zeros(n.shape[0], cfg.hidden_size, dtype=torch.float32, device=n.device)
    for e in torch.unique(top_i).tolist():
        tok, slot = torch.nonzero(top_i == e, as_tuple=True)
        fp8 = lw.fp8_experts[e] if lw.fp8_experts is not None else (None, None)
        g, u = _linear(n[tok], lw.experts_gate_up[e], fp8[0]).chunk(2, dim=-1)
        y = _linear(F.silu(g) * u, lw.experts_down[e], fp8[1])
        out.index_add_(0, tok, y.to(torch.float32) * top_w[tok, slot, None])
    return out.to(n.dtype), top_i.to(torch.int32)


def _mlp_and_out(w: Weights, lw: LayerWeights, x: torch.Tensor, attn: torch.Tensor,
                 routing: list[torch.Tensor] | None) -> torch.Tensor:
    cfg = w.cfg
    hdn = x + _linear(attn, lw.wo, lw.fp8["self_attn.o_proj"] if lw.fp8 else None)
    n = rms_norm(hdn, lw.ln2, cfg.rms_norm_eps)
    if lw.router is not None:
        y, experts = _moe(w, lw, n)
        if routing is not None:
            routing.append(experts)
        return hdn + y
    gu = _linear(n, lw.w_gate_up, lw.fp8["gate_up"] if lw.fp8 else None)
    g, u = gu.chunk(2, dim=-1)
    return hdn + _linear(F.silu(g) * u, lw.w_down, lw.fp8["mlp.down_proj"] if lw.fp8 else None)


def _stack_routing(per_layer: list[torch.Tensor], out: list[torch.Tensor] | None) -> None:
    if out is not None and per_layer:
        out.append(torch.stack(per_layer, dim=1))        # [tokens, layers, k]


def _logits(w: Weights, x: torch.Tensor) -> torch.Tensor:
    n = rms_norm(x, w.norm, w.cfg.rms_norm_eps)
    return F.linear(n, w.lm_head).to(torch.float32)


# ---- entry points ------------------------------------------------------------------------------
@torch.inference_mode()
def prefill_many(w: Weights, kv: KVPool, items: list[tuple[int, list[int], int]], *,
                 all_logits: bool = False, routing: list[torch.Tensor] | None = None,
                 hidden_out: list[torch.Tensor] | None = None) -> torch.Tensor:
    """Prefill several requests at once: items are (slot, ids, start), the tokens `ids` at positions
    start.. of the request in `slot` (positions < start are already cached). The linears run once over
    all the new tokens; attention runs per request over its own slot. Writes the KV. Returns the fp32
    logits of each item's last token [items, vocab] (of every new token [tokens, vocab] with all_logits).
    MoE models with `routing` given: appends the experts of every new token, [tokens, layers, k] int32, in
    item order. `hidden_out` given: appends the last layer's output of every new token [tokens, hidden]
    (before the final norm; `position_logprobs` turns rows of it into log-probs without a [tokens, vocab]
    tensor)."""
    cfg = w.cfg
    dev = kv.device
    ids_all: list[int] = []
    pos_parts, slot_parts, masks, spans = [], [], [], []
    for slot, ids, start in items:
        n, total = len(ids), start + len(ids)
        pos = torch.arange(start, total, device=dev)
        pos_parts.append(pos)
        slot_parts.append(torch.full((n,), slot, device=dev, dtype=torch.long))
        masks.append((torch.arange(total, device=dev)[None, :] <= pos[:, None])[None, None])   # [1,1,n,total]
        spans.append((len(ids_all), n, total))
        ids_all.extend(ids)
    pos_all, slots_all = torch.cat(pos_parts), torch.cat(slot_parts)
    x = _embed(w, torch.tensor(ids_all, device=dev), pos_all)
    scale = 1.0 / math.sqrt(cfg.head_dim)
    per_layer: list[torch.Tensor] = []
    for li, lw in enumerate(w.layers):
        q, k, v = _qkv(w, lw, x, pos_all)
        kv.write(li, slots_all, pos_all, k, v)
        outs = []
        for (slot, _, _), (off, n, total), mask in zip(items, spans, masks, strict=True):
            kk, vv = kv.read_slot(li, slot, total, w.dtype)                      # [1, kvh, total, d]
            o = F.scaled_dot_product_attention(q[off:off + n].transpose(0, 1)[None], kk, vv, attn_mask=mask,
                                               scale=scale, enable_gqa=True)    # [1, h, n, d]
            outs.append(o[0].transpose(0, 1).reshape(n, -1))
        x = _mlp_and_out(w, lw, x, torch.cat(outs) if len(outs) > 1 else outs[0], per_layer)
    _stack_routing(per_layer, routing)
    if hidden_out is not None:
        hidden_out.append(x)
    if not all_logits:
        x = x[torch.tensor([off + n - 1 for off, n, _ in spans], device=dev)]
    return _logits(w, x)


SCORE_CHUNK_ROWS = 256     # positions per [rows, vocab] fp32 block when scoring a prompt


def position_logprobs(w: Weights, hidden: torch.Tensor, targets: list[int], top_k: int = 0,
                      chunk_rows: int = SCORE_CHUNK_ROWS) -> tuple[list[float], list[list[tuple[float, int]]]]:
    """Row i of `hidden` ([n, hidden], a prefill's `hidden_out`) predicts `targets[i]`: its log-prob under
    log_softmax of the raw fp32 logits (no temperature) over the full vocabulary, and (top_k > 0) the
    top_k (log-prob, token id) pairs, highest first. Computed `chunk_rows` positions at a time, so memory
    is [chunk_rows, vocab] fp32 whatever the prompt length."""
    if hidden.shape[0] != len(targets):
        raise ValueError(f"position_logprobs: {hidden.shape[0]} hidden rows for {len(targets)} targets")
    lps: list[float] = []
    tops: list[list[tuple[float, int]]] = []
    tgt = torch.tensor(targets, dtype=torch.long, device=hidden.device)
    for a in range(0, len(targets), chunk_rows):
        lp = torch.log_softmax(_logits(w, hidden[a:a + chunk_rows]), dim=-1)      # [c, vocab] fp32
        lps.extend(lp.gather(1, tgt[a:a + chunk_rows, None])[:, 0].tolist())
        if top_k > 0:
            vals, idx = lp.topk(min(top_k, lp.shape[1]), dim=-1)
            tops.extend([list(zip(v, i, strict=True)) for v, i in zip(vals.tolist(), idx.tolist(), strict=True)])
    return lps, tops


def prefill(w: Weights, kv: KVPool, slot: int, ids: list[int], start: int, *, all_logits: bool = False,
            routing: list[torch.Tensor] | None = None) -> torch.Tensor:
    """One request's prefill (see prefill_many): logits of its last token [vocab], or [n, vocab]."""
    out = prefill_many(w, kv, [(slot, ids, start)], all_logits=all_logits, routing=routing)
    return out if all_logits else out[0]


@torch.inference_mode()
def decode(w: Weights, kv: KVPool, ids: list[int], positions: list[int], *,
           routing: list[torch.Tensor] | None = None) -> torch.Tensor:
    """One token for each running request; request b sits in slot b and its token at positions[b].
    Returns fp32 logits [batch, vocab] (MoE with `routing`: appends the experts [batch, layers, k])."""
    cfg = w.cfg
    dev = kv.device
    b = len(ids)
    pos = torch.tensor(positions, device=dev)
    length = max(positions) + 1
    x = _embed(w, torch.tensor(ids, device=dev), pos)
    slots = torch.arange(b, device=dev)
    mask = (torch.arange(length, device=dev)[None, :] <= pos[:, None])[:, None, None, :]   # [b, 1, 1, L]
    scale = 1.0 / math.sqrt(cfg.head_dim)
    per_layer: list[torch.Tensor] = []
    for li, lw in enumerate(w.layers):
        q, k, v = _qkv(w, lw, x, pos)
        kv.write(li, slots, pos, k, v)
        kk, vv = kv.read(li, b, length, w.dtype)                                 # [b, kvh, L, d]
        o = F.scaled_dot_product_attention(q[:, :, None, :], kk, vv, attn_mask=mask, scale=scale,
                                           enable_gqa=True)                     # [b, h, 1, d]
        x = _mlp_and_out(w, lw, x, o.reshape(b, -1), per_layer)
    _stack_routing(per_layer, routing)
    return _logits(w, x)


@torch.inference_mode()
def forward_full(w: Weights, ids: list[int], kv_dtype: str = "fp32", *,
                 routing: list[torch.Tensor] | None = None) -> torch.Tensor:
    """Logits [len(ids), vocab] of a whole sequence (teacher forcing), through a scratch KV cache
    (MoE with `routing`: appends the experts of every position, [len(ids), layers, k] int32)."""
    cfg = w.cfg
    kv = KVPool(num_layers=cfg.num_hidden_layers, kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                max_context=cfg.max_position_embeddings, kv_dtype=kv_dtype, device=w.embed.device)
    kv.ensure(1, len(ids))
    return prefill(w, kv, 0, list(ids), 0, all_logits=True, routing=routing)
