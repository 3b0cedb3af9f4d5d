"""The embedded engine on the Qwen3 and Qwen3-MoE layouts, judged by an independent reference: Hugging Face
transformers' Qwen3ForCausalLM / Qwen3MoeForCausalLM, built from the same tiny config.json by its own loader
(no download), on the checkpoint `init-model` wrote. In fp32 the engine's logits and log-prob records match
HF's to ~1e-4 and its routed experts are HF's router's top-k, token for token, layer for layer. Then the MoE
in every serving precision (experts quantized, router in bf16) and SGLang's routed-experts protocol."""

from __future__ import annotations

import base64
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from mixfleet.costmodel.specs.model import load_model_spec
from mixfleet.runner.checkpoint.hf_checkpoint import load_checkpoint
from mixfleet.runner.checkpoint.init_model import init_model
from mixfleet.runner.checkpoint.tokenizer import ByteTokenizer
from mixfleet.runner.sampler.client import routed_experts
from mixfleet.runner.sampler.engine import Engine
from mixfleet.runner.sampler.engine.model import forward_full, load_weights
from mixfleet.runner.sampler.engine.quant import fake_quantize
from mixfleet.runner.sampler.engine_api import EngineRequest, RequestResult, SamplingParams
from mixfleet.runner.sampler.protocol_response import decode_routed_experts
from mixfleet.runner.sampler.server import ServerArgs
from mixfleet.runner.sampler.server_launch import start_in_thread

transformers = pytest.importorskip("transformers")

TOK = ByteTokenizer()
PROMPTS = [TOK.encode(f"<|user|>{t}<|assistant|>") for t in ("Name a color.", "What is 2+2?", "Hi")]
LAYERS, TOP_K, EXPERTS = 4, 2, 8


pytestmark = pytest.mark.usefixtures("one_torch_thread")   # tests/conftest.py


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("qwen3")
    return {n: init_model(load_model_spec(n), root / n, seed=0) for n in ("tiny-qwen3", "tiny-qwen3-moe")}


def run(engine: Engine, reqs: list[EngineRequest]) -> dict[str, RequestResult]:
    out: dict[str, RequestResult] = {}
    for r in reqs:
        engine.add_request(r, on_finish=lambda res: out.__setitem__(res.rid, res))
    while engine.step():
        pass
    return out


def sample(rid: str, ids: list[int], n: int = 16, seed: int = 0, **kw) -> EngineRequest:
    return EngineRequest(rid=rid, input_ids=ids, return_logprob=True, **kw,
                         params=SamplingParams(max_new_tokens=n, temperature=1.0, sampling_seed=seed, ignore_eos=True))


def hf_model(path: Path):
    """HF transformers' own class for the checkpoint (Qwen3ForCausalLM / Qwen3MoeForCausalLM), by its loader."""
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True,
                                                             attn_implementation="eager").eval()


def hf_forward(model, seq: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """HF transformers' logits [n, vocab] and (MoE) router top-k experts [n, layers, k] of one sequence."""
    moe = model.config.model_type == "qwen3_moe"
    with torch.no_grad():
        out = model(torch.tensor([seq]), output_router_logits=moe)
    experts = None
    if moe:   # HF's router: softmax, then torch.topk of the probabilities (same order as of the logits)
        experts = torch.stack([rl.topk(model.config.num_experts_per_tok, dim=-1).indices for rl in out.router_logits],
                              dim=1)
    return out.logits[0], experts


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-qwen3-moe"])
def test_fp32_engine_matches_hf_transformers(ckpts: dict[str, Path], name: str) -> None:
    path = ckpts[name]
    moe = name.endswith("moe")
    engine = Engine(path, precision="fp32", kv_cache_dtype="fp32", enable_return_routed_experts=moe)
    reqs = [sample(f"r{i}", p, seed=i, return_routed_experts=moe) for i, p in enumerate(PROMPTS)]
    res = run(engine, reqs)                       # prefill + batched decode, the serving path
    model = hf_model(path)
    assert type(model).__name__ == ("Qwen3MoeForCausalLM" if moe else "Qwen3ForCausalLM")
    diffs = []
    for r in reqs:
        out = res[r.rid]
        seq = r.input_ids + out.output_ids
        hf_logits, hf_experts = hf_forward(model, seq)
        # the full teacher-forced forward agrees with HF's logits
        ours = forward_full(engine.weights, seq)
        diffs.append((ours - hf_logits).abs().max().item())
        # and so do the per-token log-prob records the engine wrote while it sampled
        n0 = len(r.input_ids) - 1
        hf_lp = torch.log_softmax(hf_logits[n0:n0 + len(out.output_ids)], -1)
        hf_lp = hf_lp.gather(1, torch.tensor(out.output_ids)[:, None])[:, 0]
        assert torch.allclose(torch.tensor([t.logprob for t in out.tokens]), hf_lp, atol=1e-4)
        if moe:
            assert out.routed_experts.shape == (len(seq) - 1, LAYERS, TOP_K)
            assert torch.equal(out.routed_experts.sort(-1).values, hf_experts[:-1].sort(-1).values.to(torch.int32))
    assert max(diffs) < 1e-4, diffs
    print(f"{name}: max |logit diff| vs HF transformers (fp32) = {max(diffs):.2e}")


@pytest.mark.parametrize("precision", ["bf16", "fp8", "nvfp4", "mxfp4"])
def test_moe_serves_in_each_precision(ckpts: dict[str, Path], precision: str) -> None:
    path = ckpts["tiny-qwen3-moe"]
    _, t = load_checkpoint(path)
    engine = Engine(path, precision=precision, kv_cache_dtype="bf16", kernel="fp32", enable_return_routed_experts=True)
    lw = engine.weights.layers[1]
    # every expert's matrices are quantized to the precision (each on its own); the router stays bf16
    for e in (0, 5):
        gate = t[f"model.layers.1.mlp.experts.{e}.gate_proj.weight"]
        down = t[f"model.layers.1.mlp.experts.{e}.down_proj.weight"]
        assert torch.equal(lw.experts_gate_up[e, : gate.shape[0]], fake_quantize(gate, precision))
        assert torch.equal(lw.experts_down[e], fake_quantize(down, precision))
        assert not torch.equal(lw.experts_down[e], down)
    assert torch.equal(lw.router, t["model.layers.1.mlp.gate.weight"].to(torch.bfloat16).float())
    reqs = [sample(f"r{i}", p, n=12, seed=i, return_routed_experts=True) for i, p in enumerate(PROMPTS)]
    res = run(engine, reqs)
    same = []
    for r in reqs:
        out = res[r.rid]
        seq = r.input_ids + out.output_ids
        routing: list[torch.Tensor] = []
        lp = torch.log_softmax(forward_full(engine.weights, seq, "bf16", routing=routing), -1)
        n0 = len(r.input_ids) - 1
        rec = torch.tensor([tk.logprob for tk in out.tokens])
        full = lp[n0:n0 + len(out.output_ids)].gather(1, torch.tensor(out.output_ids)[:, None])[:, 0]
        assert torch.allclose(rec, full, atol=2e-2)
        experts = out.routed_experts
        assert experts.shape == (len(seq) - 1, LAYERS, TOP_K) and experts.dtype == torch.int32
        assert int(experts.min()) >= 0 and int(experts.max()) < EXPERTS
        assert (experts[..., 0] != experts[..., 1]).all()
        same.append((experts.sort(-1).values == routing[0][:-1].sort(-1).values).all(-1).double().mean().item())
    assert min(same) > 0.95, same     # decode vs the teacher-forced forward: same weights, same routing
    # the quantization error moves some tokens to other experts than the fp32 reference picks
    ref = load_weights(path, precision="fp32", kernel="fp32")
    seq = PROMPTS[0] + res["r0"].output_ids
    a, b = [], []
    forward_full(ref, seq, routing=a)
    forward_full(engine.weights, seq, "bf16", routing=b)
    differs = (a[0].sort(-1).values != b[0].sort(-1).values).any(-1).any(-1).double().mean().item()
    assert differs < 0.5
    print(f"{precision}: share of positions routed differently from fp32 in >= 1 layer: {differs:.2%}")


def test_prefix_reuse_keeps_the_routing_record(ckpts: dict[str, Path]) -> None:
    engine = Engine(ckpts["tiny-qwen3-moe"], precision="fp32", kv_cache_dtype="fp32", enable_return_routed_experts=True)
    first = run(engine, [sample("t1", PROMPTS[0], n=8, session_id="s", return_routed_experts=True)])["t1"]
    turn2 = PROMPTS[0] + first.output_ids + TOK.encode("<|user|>more<|assistant|>")
    cached = run(engine, [sample("t2", turn2, n=8, session_id="s", return_routed_experts=True)])["t2"]
    fresh = run(Engine(ckpts["tiny-qwen3-moe"], precision="fp32", kv_cache_dtype="fp32",
                       enable_return_routed_experts=True), [sample("t2", turn2, n=8, return_routed_experts=True)])["t2"]
    assert cached.cached_tokens > len(PROMPTS[0]) and fresh.cached_tokens == 0
    assert cached.output_ids == fresh.output_ids
    assert torch.equal(cached.routed_experts, fresh.routed_experts)     # cached rows come from the session
    start = run(engine, [sample("t3", turn2, n=4, return_routed_experts=True, routed_experts_start_len=5)])["t3"]
    assert start.routed_experts.shape[0] == len(turn2) + 4 - 1 - 5


def test_routed_experts_protocol(ckpts: dict[str, Path]) -> None:
    """SGLang's fields: `--enable-return-routed-experts`, `return_routed_experts`, `routed_experts_start_len`,
    `meta_info.routed_experts` = base64 of int32 [prompt + completion - 1 - start, layers, top_k]."""
    path = ckpts["tiny-qwen3-moe"]
    engine = Engine(path, precision="fp32", kv_cache_dtype="fp32", enable_return_routed_experts=True)
    with start_in_thread(engine, server_args=ServerArgs(port=0)) as h, \
            httpx.Client(base_url=h.url, timeout=60, trust_env=False) as c:
        body = {"input_ids": PROMPTS[1], "return_routed_experts": True,
                "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}
        out = c.post("/generate", json=body).json()
        meta = out["meta_info"]
        assert isinstance(meta["routed_experts"], str)
        raw = base64.b64decode(meta["routed_experts"])
        rows = meta["prompt_tokens"] + meta["completion_tokens"] - 1
        assert len(raw) == rows * LAYERS * TOP_K * 4                         # int32
        arr = np.frombuffer(raw, dtype="<i4").reshape(rows, LAYERS, TOP_K)
        routing: list[torch.Tensor] = []
        forward_full(engine.weights, (PROMPTS[1] + out["output_ids"])[:-1], routing=routing)
        assert np.array_equal(np.sort(arr, -1), routing[0].sort(-1).values.numpy())
        assert np.array_equal(routed_experts(out, num_layers=LAYERS, top_k=TOP_K), arr)
        # start offset, batches with a per-prompt flag, streaming (the record comes with the final chunk only)
        part = c.post("/generate", json={**body, "routed_experts_start_len": 3}).json()
        assert np.array_equal(routed_experts(part, num_layers=LAYERS, top_k=TOP_K, routed_experts_start_len=3),
                              arr[3:])
        both = c.post("/generate", json={**body, "input_ids": [PROMPTS[1], PROMPTS[2]],
                                         "return_routed_experts": [True, False]}).json()
        assert "routed_experts" in both[0]["meta_info"] and "routed_experts" not in both[1]["meta_info"]
        plain = c.post("/generate", json={**body, "return_routed_experts": False}).json()
        assert "routed_experts" not in plain["meta_info"]
        lines = c.post("/generate", json={**body, "stream": True}).text.splitlines()
        chunks = [line for line in lines if line.startswith("data: {")]
        assert ["routed_experts" in ch for ch in chunks] == [False] * (len(chunks) - 1) + [True]
        # bad input: 400 naming the field
        r = c.post("/generate", json={**body, "routed_experts_start_len": 99})
        assert r.status_code == 400 and "routed_experts_start_len" in r.json()["error"]["message"]
        assert c.get("/get_model_info").json()["model_type"] == "qwen3_moe"
    # the server flag is needed, and only a MoE model takes it
    with start_in_thread(Engine(path, precision="bf16"), server_args=ServerArgs(port=0)) as h, \
            httpx.Client(base_url=h.url, timeout=60, trust_env=False) as c:
        r = c.post("/generate", json=body)
        assert r.status_code == 400 and "--enable-return-routed-experts" in r.json()["error"]["message"]
    with pytest.raises(ValueError, match="has no experts"):
        Engine(ckpts["tiny-qwen3"], enable_return_routed_experts=True)


def test_client_reads_sglangs_encoding() -> None:
    """An answer as real SGLang writes it (pybase64 of the int32 tensor's bytes) decodes to the same array."""
    expected = np.arange(5 * LAYERS * TOP_K, dtype=np.int32).reshape(5, LAYERS, TOP_K) % EXPERTS
    payload = base64.b64encode(torch.from_numpy(expected).numpy().tobytes()).decode("utf-8")
    resp = {"meta_info": {"prompt_tokens": 4, "completion_tokens": 2, "routed_experts": payload}}
    assert np.array_equal(routed_experts(resp, num_layers=LAYERS, top_k=TOP_K), expected)
    assert routed_experts({"meta_info": {}}, num_layers=LAYERS, top_k=TOP_K) is None
    with pytest.raises(ValueError, match="5 rows, expected 4"):
        routed_experts(resp, num_layers=LAYERS, top_k=TOP_K, routed_experts_start_len=1)
    with pytest.raises(ValueError, match="whole number of rows"):
        decode_routed_experts(payload, num_layers=3, top_k=TOP_K)
    with pytest.raises(ValueError, match="base64"):
        decode_routed_experts("not base64!", num_layers=LAYERS, top_k=TOP_K)
