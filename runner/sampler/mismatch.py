"""Measured sampler-trainer mismatch of each serving precision against a float32 reference policy.

`mixfleet mismatch` feeds the same prompts to an embedded engine per precision (its weights
quantized, its KV cache in the given dtype, its kernel dtype), lets it *sample* as an RL sampler
does (temperature T, seeded), and scores every sampled token against the float32 reference
(fp32 weights, fp32 KV, fp32 kernel) evaluated on the same sequence (teacher forcing), at the same
temperature. Per precision, over all sampled tokens, with q = sampler and p = reference and
r = p / q on the sampled token:

- k1 = mean(log q - log p), k3 = mean(r - 1 - log r) (both estimate KL(q || p); k3 >= 0),
- kl_exact = mean over positions of the full-vocabulary KL(q || p) (q from the precision's own
  teacher-forced forward), a low-variance check on k1 / k3,
- mean |log r|, the share of tokens with r outside the band [0.2, 5] (split low / high),
- top-1 agreement: the sampler's most likely token equals the reference's.
- MoE models: routing disagreement. The engine records the experts each token was routed to while it
  sampled (SGLang's routed-experts record); the reference routes the same sequence. Over the positions
  that produced sampled tokens: the share of tokens whose top-k expert *set* differs from the reference's
  in at least one layer, and the mean share of layers whose set differs (None for dense models).

These are the numbers the cost model's mismatch priors (kl_k3, extreme_share) stand for.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from mixfleet.costmodel.specs.formats import formats
from mixfleet.runner.sampler.engine import Engine, EngineConfig
from mixfleet.runner.sampler.engine.kvcache import KV_DTYPES
from mixfleet.runner.sampler.engine.model import Weights, forward_full, load_weights
from mixfleet.runner.sampler.engine.quant import WEIGHT_PRECISIONS
from mixfleet.runner.sampler.engine_api import EngineRequest, RequestResult, SamplingParams

BAND = (0.2, 5.0)
_PROMPTS = (
    "Write a short poem about the sea.",
    "What is 17 times 23?",
    "Explain how a hash map works.",
    "List three prime numbers greater than 100.",
    "Translate 'good morning' into French.",
    "Summarize the plot of a detective story in two sentences.",
    "def fibonacci(n):",
    "The capital of Australia is",
    "Give me a recipe for pancakes.",
    "Why is the sky blue?",
    "Sort these words: pear, apple, fig.",
    "Call the weather tool for Paris.",
)


@dataclass(frozen=True, kw_only=True)
class MismatchConfig:
    """What to measure: which precisions, on which KV dtype and kernel, over how many sampled tokens."""

    precisions: tuple[str, ...] = formats().gpu_precisions   # bf16, fp8, nvfp4, mxfp4 (data/precisions.toml)
    kv_cache_dtype: str = "fp8_e4m3"
    kernel: str | None = None                # None: each precision's default (bf16; fp32 for fp32)
    weight_noise: float = 0.0                # the engine's emulated kernel error (relative std; 0 = off)
    num_prompts: int = 12
    max_new_tokens: int = 48                 # per prompt (tokens)
    temperature: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.precisions:
            raise ValueError("mismatch: precisions is empty; allowed: a list of " + ", ".join(WEIGHT_PRECISIONS))
        for p in self.precisions:
            if p not in WEIGHT_PRECISIONS:
                raise ValueError(f"mismatch: precision {p!r}; allowed: {', '.join(WEIGHT_PRECISIONS)}")
        if self.kv_cache_dtype not in KV_DTYPES:
            raise ValueError(f"mismatch: kv_cache_dtype {self.kv_cache_dtype!r}; allowed: {', '.join(KV_DTYPES)}")
        try:
            EngineConfig(kernel=self.kernel, weight_noise=self.weight_noise)   # the engine's own checks
        except ValueError as e:
            raise ValueError(f"mismatch: {e}") from None
        for name in ("num_prompts", "max_new_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"mismatch: {name} = {v!r}; allowed: a positive integer")
        if not 0 < self.temperature < float("inf"):
            raise ValueError(f"mismatch: temperature = {self.temperature!r}; allowed: a number > 0")


@dataclass(frozen=True, kw_only=True)
class MismatchRow:
    precision: str
    kv_cache_dtype: str
    kernel: str
    weight_noise: float                      # the engine's emulated kernel error (0 = off)
    tokens: int                              # sampled tokens scored
    k1: float
    k3: float
    kl_exact: float
    mean_abs_log_ratio: float
    share_outside_band: float
    share_low: float                         # r < 0.2
    share_high: float                        # r > 5
    top1_agreement: float
    routing_disagree_share: float | None = None   # MoE: tokens with >= 1 layer whose top-k set differs
    routing_layer_share: float | None = None      # MoE: mean share of layers whose top-k set differs

    def to_dict(self) -> dict:
        return asdict(self)


def prompts(tokenizer, n: int) -> list[list[int]]:
    """n chat-formatted prompts (cycled from a fixed list, numbered when repeated)."""
    out = []
    for i in range(n):
        text = _PROMPTS[i % len(_PROMPTS)] + (f" ({i // len(_PROMPTS)})" if i >= len(_PROMPTS) else "")
        out.append(tokenizer.encode(f"<|user|>{text}<|assistant|>"))
    return out


def _generate(engine: Engine, prompt_ids: list[list[int]], cfg: MismatchConfig) -> list[RequestResult]:
    results: dict[str, RequestResult] = {}
    for i, ids in enumerate(prompt_ids):
        params = SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                                sampling_seed=cfg.seed * 100_003 + i)
        routed = engine.config.enable_return_routed_experts
        engine.add_request(EngineRequest(rid=f"m{i}", input_ids=ids, params=params, return_logprob=True,
                                         top_logprobs_num=1, return_routed_experts=routed),
                           on_finish=lambda r: results.__setitem__(r.rid, r))
    while engine.step():
        pass
    return [results[f"m{i}"] for i in range(len(prompt_ids))]


def score(ref: Weights, sampler: Weights, kv_cache_dtype: str, prompt_ids: list[list[int]],
          results: list[RequestResult], temperature: float) -> dict[str, float]:
    """The mismatch numbers of one sampler's generations against the reference weights."""
    log_q, log_p, agree, kl, set_diff = [], [], [], [], []
    for ids, res in zip(prompt_ids, results, strict=True):
        if not res.output_ids:
            continue
        seq = ids + res.output_ids
        n0, n = len(ids) - 1, len(res.output_ids)
        ref_routing: list[torch.Tensor] | None = [] if res.routed_experts is not None else None
        lp = torch.log_softmax(forward_full(ref, seq, "fp32", routing=ref_routing)[n0:n0 + n].double() / temperature,
                               dim=-1)
        if ref_routing is not None:         # positions n0 .. n0+n-1 produced the n sampled tokens
            mine = res.routed_experts[n0:n0 + n].sort(dim=-1).values
            theirs = ref_routing[0][n0:n0 + n].sort(dim=-1).values
            set_diff.append((mine != theirs).any(dim=-1))            # [n, layers]: this layer's set differs
        lq = torch.log_softmax(forward_full(sampler, seq, kv_cache_dtype)[n0:n0 + n].double() / temperature, dim=-1)
        tok = torch.tensor(res.output_ids)
        log_p.append(lp.gather(1, tok[:, None])[:, 0])
        log_q.append(torch.tensor([t.logprob for t in res.tokens], dtype=torch.float64))
        agree.append(torch.tensor([t.top_logprobs[0][1] for t in res.tokens]) == lp.argmax(-1))
        kl.append((lq.exp() * (lq - lp)).sum(-1))
    lq_all, lp_all = torch.cat(log_q), torch.cat(log_p)
    log_r = lp_all - lq_all
    r = log_r.exp()
    low, high = (r < BAND[0]).double().mean().item(), (r > BAND[1]).double().mean().item()
    routing = {}
    if set_diff:
        d = torch.cat(set_diff).double()
        routing = {"routing_disagree_share": d.amax(dim=1).mean().item(), "routing_layer_share": d.mean().item()}
    return {**routing, "tokens": int(lq_all.numel()), "k1": (lq_all - lp_all).mean().item(),
            "k3": (torch.expm1(log_r) - log_r).mean().item(), "kl_exact": torch.cat(kl).mean().item(),
            "mean_abs_log_ratio": log_r.abs().mean().item(), "share_outside_band": low + high,
            "share_low": low, "share_high": high, "top1_agreement": torch.cat(agree).double().mean().item()}


def measure_mismatch(model_path: str, cfg: MismatchConfig) -> list[MismatchRow]:
    """One row per precision of cfg, in order."""
    ref = load_weights(model_path, precision="fp32", kernel="fp32")
    rows = []
    for precision in cfg.precisions:
        engine = Engine(model_path, precision=precision, kv_cache_dtype=cfg.kv_cache_dtype, kernel=cfg.kernel,
                        weight_noise=cfg.weight_noise, seed=cfg.seed, enable_return_routed_experts=ref.cfg.is_moe)
        ids = prompts(engine.tokenizer, cfg.num_prompts)
        too_long = max(len(x) for x in ids) + cfg.max_new_tokens
        if too_long > engine.context_length:
            raise ValueError(f"mismatch: max_new_tokens = {cfg.max_new_tokens} makes prompts of {too_long} tokens, "
                             f"over the model's context length {engine.context_length}")
        results = _generate(engine, ids, cfg)
        nums = score(ref, engine.weights, cfg.kv_cache_dtype, ids, results, cfg.temperature)
        rows.append(MismatchRow(precision=precision, kv_cache_dtype=cfg.kv_cache_dtype, kernel=engine.kernel,
                                weight_noise=engine.config.weight_noise, **nums))
    return rows


def format_table(rows: list[MismatchRow]) -> str:
    """A plain-text table of the rows."""
    head = ("precision", "kv", "kernel", "tokens", "k1", "k3", "KL exact", "|log r|", "outside[0.2,5]", "top-1 agree")
    moe = any(r.routing_disagree_share is not None for r in rows)
    if moe:
        head = (*head, "routing differs", "layers differ")
    lines = [head]
    for r in rows:
        kernel = r.kernel + (f" noise {r.weight_noise:g}" if r.weight_noise else "")
        line = (r.precision, r.kv_cache_dtype, kernel, str(r.tokens), f"{r.k1:.2e}", f"{r.k3:.2e}",
                f"{r.kl_exact:.2e}", f"{r.mean_abs_log_ratio:.3f}", f"{r.share_outside_band:.2%}",
                f"{r.top1_agreement:.2%}")
        if moe:
            line = (*line, *(f"{x:.2%}" if x is not None else "-"
                             for x in (r.routing_disagree_share, r.routing_layer_share)))
        lines.append(line)
    widths = [max(len(x[i]) for x in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) if j >= 3 else c.ljust(w) for j, (c, w) in enumerate(zip(x, widths,
                                                                                                     strict=True)))
                     for x in lines)
