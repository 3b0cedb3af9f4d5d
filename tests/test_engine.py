"""The embedded engine on the tiny model (a seeded `init-model` checkpoint): greedy bf16 equals the fp32
reference, log-prob records agree with a full forward, stop rules, request validation, fp8 KV close
to bf16 KV, and the forward matches a plain re-implementation of hf_checkpoint's definition."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from mixfleet.costmodel.specs.model import load_model_spec
from mixfleet.runner.checkpoint.hf_checkpoint import HFConfig, load_checkpoint, save_checkpoint
from mixfleet.runner.checkpoint.init_model import init_model, init_tensors
from mixfleet.runner.checkpoint.tokenizer import ByteTokenizer
from mixfleet.runner.sampler.engine import Engine
from mixfleet.runner.sampler.engine.model import (
    forward_full,
    load_weights,
    scaled_mm_linear,
    scaled_mm_unsupported,
)
from mixfleet.runner.sampler.engine.quant import quantize_fp8
from mixfleet.runner.sampler.engine_api import EngineRequest, RequestResult, SamplingParams, TokenOutput

TOK = ByteTokenizer()
PROMPT = TOK.encode("<|user|>Hello, world!<|assistant|>")


pytestmark = pytest.mark.usefixtures("one_torch_thread")   # tests/conftest.py


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(load_model_spec("tiny"), tmp_path_factory.mktemp("ck") / "tiny", seed=0)


def run(engine: Engine, reqs: list[EngineRequest], tokens: dict[str, list[TokenOutput]] | None = None
        ) -> dict[str, RequestResult]:
    out: dict[str, RequestResult] = {}
    for r in reqs:
        cb = (lambda t, rid=r.rid: tokens.setdefault(rid, []).append(t)) if tokens is not None else None
        engine.add_request(r, on_finish=lambda res: out.__setitem__(res.rid, res), on_token=cb)
    for _ in range(10_000):
        if not engine.step():
            break
    return out


def greedy(rid: str, ids: list[int], n: int = 16, **kw) -> EngineRequest:
    return EngineRequest(rid=rid, input_ids=ids, params=SamplingParams(max_new_tokens=n, temperature=0.0, **kw))


def test_greedy_bf16_equals_fp32_reference(ckpt: Path) -> None:
    # prompt chosen (seed 0) so that every step's top-1 leads its runner-up by >= 0.3 in the fp32
    # reference's logits, ~3x the largest bf16-vs-fp32 logit difference: equal greedy outputs are then
    # a real check of the bf16 path, not luck, and stay so on other CPUs' bf16 rounding
    prompt = TOK.encode("<|user|>Name a color.<|assistant|>")
    ref = run(Engine(ckpt, precision="fp32", kv_cache_dtype="fp32"), [greedy("a", prompt, 12)])["a"]
    bf = run(Engine(ckpt, precision="bf16", kv_cache_dtype="bf16"), [greedy("a", prompt, 12)])["a"]
    assert len(set(ref.output_ids)) >= 8, "degenerate check: the reference repeats itself"
    assert bf.output_ids == ref.output_ids
    # the engine's greedy decode is the argmax chain of the definition's full forward
    w = load_weights(ckpt, precision="fp32", kernel="fp32")
    logits = forward_full(w, prompt + ref.output_ids)[len(prompt) - 1:-1]
    assert logits.argmax(-1).tolist() == ref.output_ids
    top2 = logits.topk(2, -1).values
    assert (top2[:, 0] - top2[:, 1]).min().item() > 0.25
    assert ref.finish_reason == {"type": "length", "length": 12}
    assert ref.prompt_tokens == len(prompt) and ref.cached_tokens == 0 and ref.weight_version == "0"


def _reference_forward(cfg: HFConfig, t: dict[str, torch.Tensor], ids: list[int]) -> torch.Tensor:
    """hf_checkpoint's forward written out plainly in fp64 (no cache, no fusion)."""
    t = {k: v.double() for k, v in t.items()}
    n = len(ids)

    def norm(x, w):
        return w * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)

    x = t["model.embed_tokens.weight"][ids] + t["model.embed_positions.weight"][:n]
    h, kvh, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        a = norm(x, t[p + "input_layernorm.weight"])
        q = (a @ t[p + "self_attn.q_proj.weight"].T).view(n, h, d)
        k = (a @ t[p + "self_attn.k_proj.weight"].T).view(n, kvh, d)
        v = (a @ t[p + "self_attn.v_proj.weight"].T).view(n, kvh, d)
        outs = []
        for j in range(h):
            kj, vj = k[:, j // (h // kvh)], v[:, j // (h // kvh)]
            s = q[:, j] @ kj.T / math.sqrt(d)
            s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
            outs.append(torch.softmax(s, -1) @ vj)
        x = x + torch.cat(outs, -1) @ t[p + "self_attn.o_proj.weight"].T
        m = norm(x, t[p + "post_attention_layernorm.weight"])
        x = x + (F.silu(m @ t[p + "mlp.gate_proj.weight"].T) * (m @ t[p + "mlp.up_proj.weight"].T)) @ \
            t[p + "mlp.down_proj.weight"].T
    return norm(x, t["model.norm.weight"]) @ t["lm_head.weight"].T


def test_forward_matches_plain_definition(ckpt: Path) -> None:
    cfg, tensors = load_checkpoint(ckpt)
    ids = PROMPT + TOK.encode("abc")
    ref = _reference_forward(cfg, tensors, ids)
    got = forward_full(load_weights(ckpt, precision="fp32", kernel="fp32"), ids).double()
    assert (got - ref).abs().max() < 1e-3 * ref.abs().max()


def test_rope_model_decode_matches_full_forward(tmp_path: Path) -> None:
    spec = load_model_spec("tiny")
    cfg = HFConfig.from_spec(spec)
    cfg = HFConfig(**{**{k: getattr(cfg, k) for k in cfg.__dataclass_fields__}, "position_embedding_type": "rope",
                      "num_hidden_layers": 2})
    path = save_checkpoint(tmp_path / "rope", cfg, init_tensors(cfg, seed=3), tokenizer=TOK)
    res = run(Engine(path, precision="fp32", kv_cache_dtype="fp32"), [greedy("a", PROMPT, 10)])["a"]
    logits = forward_full(load_weights(path, precision="fp32", kernel="fp32"), PROMPT + res.output_ids)
    assert logits[len(PROMPT) - 1:-1].argmax(-1).tolist() == res.output_ids
    assert len(set(res.output_ids)) >= 4


def test_logprob_records_consistent_with_full_forward(ckpt: Path) -> None:
    temp, k = 0.8, 5
    eng = Engine(ckpt, precision="fp32", kv_cache_dtype="fp32")
    reqs = [EngineRequest(rid=f"r{i}", input_ids=TOK.encode(f"<|user|>Say {i}<|assistant|>"),
                          params=SamplingParams(max_new_tokens=12, temperature=temp, top_p=0.9, top_k=40, min_p=0.01,
                                                sampling_seed=i, ignore_eos=True),
                          return_logprob=True, top_logprobs_num=k, return_sampling_mask=True) for i in range(3)]
    streamed: dict[str, list[TokenOutput]] = {}
    res = run(eng, reqs, streamed)
    w = load_weights(ckpt, precision="fp32", kernel="fp32")
    mask_sizes = []
    for r in reqs:
        out = res[r.rid]
        assert streamed[r.rid] == out.tokens and [t.token_id for t in out.tokens] == out.output_ids
        lp = torch.log_softmax(forward_full(w, r.input_ids + out.output_ids) / temp, -1)
        for j, tok in enumerate(out.tokens):
            row = lp[len(r.input_ids) - 1 + j]
            assert tok.logprob == pytest.approx(row[tok.token_id].item(), abs=1e-4)
            assert len(tok.top_logprobs) == k
            vals = [v for v, _ in tok.top_logprobs]
            assert vals == sorted(vals, reverse=True)
            assert [i for _, i in tok.top_logprobs] == row.topk(k).indices.tolist()
            # kept set: the rule applied to the full distribution, log-probs renormalized over it
            p = row.exp()
            ps, order = p.sort(descending=True)
            excl = ps.cumsum(0) - ps
            keep = [i for i in range(len(ps)) if i == 0 or (i < 40 and excl[i] <= 0.9 and ps[i] >= 0.01 * ps[0])]
            assert tok.mask_ids == order[keep].tolist()
            assert tok.token_id in tok.mask_ids
            assert torch.logsumexp(torch.tensor(tok.mask_logprobs, dtype=torch.float64), 0).item() == \
                pytest.approx(0.0, abs=1e-5)
            assert tok.mask_logprobs == sorted(tok.mask_logprobs, reverse=True)
            mask_sizes.append(len(tok.mask_ids))
    assert max(mask_sizes) > 1


def test_seeded_sampling_reproducible_and_seed_dependent(ckpt: Path) -> None:
    def sample(seed: int) -> list[int]:
        req = EngineRequest(rid="s", input_ids=PROMPT, params=SamplingParams(max_new_tokens=16, sampling_seed=seed,
                                                                             ignore_eos=True))
        return run(Engine(ckpt, precision="bf16"), [req])["s"].output_ids

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


def test_greedy_mask_and_topk_one(ckpt: Path) -> None:
    req = EngineRequest(rid="g", input_ids=PROMPT, params=SamplingParams(max_new_tokens=4, temperature=0.0),
                        return_sampling_mask=True, top_logprobs_num=1)
    out = run(Engine(ckpt, precision="bf16"), [req])["g"]
    for t in out.tokens:
        assert t.mask_ids == [t.token_id] and t.mask_logprobs == [0.0]
        assert t.top_logprobs[0][1] == t.token_id and t.top_logprobs[0][0] == pytest.approx(t.logprob)


def _eos_checkpoint(ckpt: Path, dest: Path) -> tuple[Path, int]:
    """A copy of the tiny model whose EOS logit beats the greedy first token's (EOS row = 1.5 x its row)."""
    cfg, t = load_checkpoint(ckpt)
    first = run(Engine(ckpt, precision="fp32", kv_cache_dtype="fp32"), [greedy("a", PROMPT, 1)])["a"].output_ids[0]
    t = dict(t)
    head = t["lm_head.weight"].clone()
    head[TOK.eos_id] = 1.5 * head[first]
    t["lm_head.weight"] = head
    return save_checkpoint(dest, cfg, t, tokenizer=TOK), first


def test_stop_rules_eos_ignore_eos_min_new_tokens_stop_ids(ckpt: Path, tmp_path: Path) -> None:
    eos_ck, _ = _eos_checkpoint(ckpt, tmp_path / "eos")
    eng = Engine(eos_ck, precision="fp32", kv_cache_dtype="fp32")
    res = run(eng, [greedy("stop", PROMPT, 8), greedy("ign", PROMPT, 8, ignore_eos=True),
                    greedy("min", PROMPT, 8, min_new_tokens=3)])
    assert res["stop"].output_ids == [TOK.eos_id]
    assert res["stop"].finish_reason == {"type": "stop", "matched": TOK.eos_id}
    assert len(res["ign"].output_ids) == 8 and res["ign"].finish_reason == {"type": "length", "length": 8}
    assert TOK.eos_id in res["ign"].output_ids                     # EOS sampled but not a stop
    assert TOK.eos_id not in res["min"].output_ids[:3]
    assert all(t.logprob > -math.inf for t in res["min"].tokens)
    # a stop_token_id ends the request at that token, which is included
    base = run(Engine(ckpt, precision="fp32", kv_cache_dtype="fp32"), [greedy("b", PROMPT, 12)])["b"].output_ids
    stop_tok = base[4]
    cut = base.index(stop_tok)
    got = run(Engine(ckpt, precision="fp32", kv_cache_dtype="fp32"),
              [greedy("c", PROMPT, 12, stop_token_ids=(stop_tok,))])["c"]
    assert got.output_ids == base[:cut + 1]
    assert got.finish_reason == {"type": "stop", "matched": stop_tok}


@pytest.mark.parametrize(("kw", "match"), [
    ({"input_ids": [1, 272]}, "outside the vocabulary"),
    ({"input_ids": [1, -1]}, "outside the vocabulary"),
    ({"input_ids": []}, "input_ids"),
    ({"params": SamplingParams(max_new_tokens=1022)}, "= 1025 exceeds the context length 1024"),
    ({"params": SamplingParams(top_p=0.0)}, r"top_p = 0.0; allowed: a number in \(0, 1\]"),
    ({"params": SamplingParams(top_k=0)}, "top_k"),
    ({"params": SamplingParams(temperature=-1.0)}, "temperature"),
    ({"params": SamplingParams(min_p=2.0)}, "min_p"),
    ({"params": SamplingParams(max_new_tokens=-2)}, "max_new_tokens"),
    ({"params": SamplingParams(stop_token_ids=(999,))}, "stop_token_ids"),
    ({"top_logprobs_num": -1}, "top_logprobs_num"),
    ({"return_sampling_mask": True}, "sampling_mask_max_tokens = 100"),
    ({"return_sampling_mask": True, "params": SamplingParams(top_k=101)}, "sampling_mask_max_tokens"),
])
def test_bad_requests_refused_at_add_time(ckpt: Path, kw: dict, match: str) -> None:
    eng = Engine(ckpt, precision="fp32", sampling_mask_max_tokens=100)
    args = {"rid": "bad", "input_ids": [1, 2, 3], **kw}
    with pytest.raises(ValueError, match=match):
        eng.add_request(EngineRequest(**args), on_finish=lambda r: None)
    assert eng.load()["num_waiting_reqs"] == 0
    # the engine still serves; a bounded kept set is accepted
    ok = EngineRequest(rid="ok", input_ids=[1, 2, 3], params=SamplingParams(max_new_tokens=2, top_k=100),
                       return_sampling_mask=True)
    assert len(run(eng, [ok])["ok"].output_ids) == 2


def test_duplicate_rid_and_budget_refusal(ckpt: Path) -> None:
    eng = Engine(ckpt, precision="fp32", max_total_tokens=64)
    eng.add_request(greedy("x", PROMPT, 4), on_finish=lambda r: None)
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request(greedy("x", PROMPT, 4), on_finish=lambda r: None)
    with pytest.raises(ValueError, match="KV-token budget 64"):
        eng.add_request(greedy("y", PROMPT, 60), on_finish=lambda r: None)


def test_engine_config_validation(ckpt: Path) -> None:
    with pytest.raises(ValueError, match="precision = 'int4'; allowed: fp32, bf16, fp8, nvfp4, mxfp4"):
        Engine(ckpt, precision="int4")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        Engine(ckpt, kv_cache_dtype="fp4")
    with pytest.raises(ValueError, match="fp8_scaled_mm = True; allowed: True only with precision 'fp8'"):
        Engine(ckpt, precision="bf16", fp8_scaled_mm=True)
    with pytest.raises(FileNotFoundError):
        Engine(ckpt.parent / "missing")


def test_max_new_tokens_zero(ckpt: Path) -> None:
    res = run(Engine(ckpt, precision="bf16"), [greedy("z", PROMPT, 0)])["z"]
    assert res.output_ids == [] and res.finish_reason == {"type": "length", "length": 0}


def test_fp8_kv_close_to_bf16_kv(ckpt: Path) -> None:
    ids = PROMPT + TOK.encode("The quick brown fox jumps over the lazy dog. " * 3)
    w = load_weights(ckpt, precision="bf16", kernel="fp32")
    lp_bf = torch.log_softmax(forward_full(w, ids, "bf16"), -1)
    lp_f8 = torch.log_softmax(forward_full(w, ids, "fp8_e4m3"), -1)
    kl = (lp_bf.exp() * (lp_bf - lp_f8)).sum(-1)
    assert 0 < kl.mean().item() < 5e-3
    assert (lp_bf.argmax(-1) == lp_f8.argmax(-1)).double().mean().item() > 0.9
    # and the two engines' greedy outputs agree on a short prompt
    a = run(Engine(ckpt, precision="bf16", kv_cache_dtype="bf16"), [greedy("a", PROMPT, 8)])["a"].output_ids
    b = run(Engine(ckpt, precision="bf16", kv_cache_dtype="fp8_e4m3"), [greedy("a", PROMPT, 8)])["a"].output_ids
    assert a[:4] == b[:4]


_CPU_FP8 = scaled_mm_unsupported("cpu")         # "" where this torch's CPU _scaled_mm takes row-wise scales
needs_cpu_fp8 = pytest.mark.skipif(bool(_CPU_FP8), reason=_CPU_FP8)


@needs_cpu_fp8
def test_fp8_scaled_mm_linear_is_a_real_fp8_gemm() -> None:
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(5, 256, generator=g), torch.randn(512, 256, generator=g) / 16
    fw = quantize_fp8(w, "channel")
    out = scaled_mm_linear(x, fw)
    ref = x @ fw.dequantize().T
    err = ((out.float() - ref).norm() / ref.norm()).item()
    assert out.shape == (5, 512)
    assert 0.005 < err < 0.05          # activations quantized to E4M3 too: more than bf16 rounding, fp8-sized


@needs_cpu_fp8
def test_fp8_scaled_mm_engine_close_to_dequantized_fp8(ckpt: Path) -> None:
    ids = PROMPT + TOK.encode("The quick brown fox jumps over the lazy dog.")
    deq = load_weights(ckpt, precision="fp8", kernel="bf16", fp8_scaling="channel")
    real = load_weights(ckpt, precision="fp8", kernel="bf16", fp8_scaled_mm=True)
    ref = load_weights(ckpt, precision="fp32", kernel="fp32")
    la, lb, lr = (torch.log_softmax(forward_full(w, ids), -1) for w in (deq, real, ref))

    def kl(p: torch.Tensor, q: torch.Tensor) -> float:
        return (p.exp() * (p - q)).sum(-1).mean().item()

    assert 0 < kl(lb, la) < 0.01
    assert kl(la, lr) < kl(lb, lr) < 0.02                       # FP8 activations add a little mismatch
    assert (la.argmax(-1) == lb.argmax(-1)).double().mean().item() > 0.9
    out = run(Engine(ckpt, precision="fp8", fp8_scaled_mm=True), [greedy("a", PROMPT, 6)])["a"]
    assert len(out.output_ids) == 6


_FP8_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.skipif(not _FP8_GPU, reason="needs a CUDA GPU with FP8 tensor cores (Ada / Hopper or newer)")
def test_fp8_scaled_mm_on_cuda_close_to_dequantized_fp8(ckpt: Path) -> None:
    """The real FP8 GEMMs on the GPU against the same weights dequantized on the GPU (not against the CPU path:
    a CPU kernel with row-wise scales is not in every torch, e.g. 2.11)."""
    ids = PROMPT + TOK.encode("The quick brown fox jumps over the lazy dog.")
    deq = load_weights(ckpt, precision="fp8", kernel="bf16", fp8_scaling="channel", device="cuda")
    real = load_weights(ckpt, precision="fp8", kernel="bf16", fp8_scaled_mm=True, device="cuda")
    la, lb = (torch.log_softmax(forward_full(w, ids).float(), -1) for w in (deq, real))
    kl = (lb.exp() * (lb - la)).sum(-1).mean().item()
    assert 0 < kl < 0.01
    assert (la.argmax(-1) == lb.argmax(-1)).double().mean().item() > 0.9
    gpu = run(Engine(ckpt, precision="fp8", fp8_scaled_mm=True, device="cuda"), [greedy("a", PROMPT, 8)])["a"]
    assert len(gpu.output_ids) == 8 and all(math.isfinite(t.logprob) for t in gpu.tokens)


def test_fp8_scaled_mm_refused_where_this_torch_has_no_kernel(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the device's _scaled_mm takes no row-wise scales the engine says so at construction, naming the
    setting, instead of failing inside the first forward (torch 2.11's CPU kernel: per-tensor scales only)."""
    import mixfleet.runner.sampler.engine.model as model

    monkeypatch.setitem(model._SCALED_MM_SUPPORT, "cpu:None", "torch 2.11 has no row-wise-scaled FP8 GEMM on cpu")
    with pytest.raises(ValueError, match="fp8_scaled_mm = True; allowed: False here .torch 2.11 has no row-wise"):
        Engine(ckpt, precision="fp8", fp8_scaled_mm=True)


def test_weight_noise_is_a_fixed_seeded_pattern(ckpt: Path) -> None:
    eng = Engine(ckpt, precision="bf16", kernel="bf16", weight_noise=0.3, seed=5)
    assert eng.config.weight_noise == 0.3 and eng.kernel == "bf16"
    clean = load_weights(ckpt, precision="bf16", kernel="bf16")
    a, b = eng.weights.layers[0].wqkv.float(), clean.layers[0].wqkv.float()
    assert ((a - b).norm() / b.norm()).item() == pytest.approx(0.3, rel=0.05)
    assert eng.update_weights_from_disk(ckpt)[0]                        # the same pattern at every load
    assert torch.equal(eng.weights.layers[0].wqkv, a.to(torch.bfloat16))
    other = Engine(ckpt, precision="bf16", kernel="bf16", weight_noise=0.3, seed=6)
    assert not torch.equal(other.weights.layers[0].wqkv, eng.weights.layers[0].wqkv)
    with pytest.raises(ValueError, match="weight_noise=0.3"):          # the retired spelling names the setting
        Engine(ckpt, kernel="bf16+noise0.3")
