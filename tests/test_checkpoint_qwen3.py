"""The Qwen3 / Qwen3-MoE checkpoint layouts `init-model` writes, judged by Hugging Face transformers (its
config classes and loader read our config.json and safetensors with no missing or unexpected key), the
transformers-5 spelling of config.json read back, and the spec checks that refuse what no layout holds."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from mixfleet.costmodel.errors import SpecError
from mixfleet.costmodel.specs.model import load_model_spec, model_spec_from_dict
from mixfleet.runner.checkpoint.hf_checkpoint import HFConfig, expected_shapes, load_checkpoint
from mixfleet.runner.checkpoint.init_model import init_model

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("qwen3")
    return {n: init_model(load_model_spec(n), root / n, seed=0) for n in ("tiny", "tiny-qwen3", "tiny-qwen3-moe")}


def test_layouts_by_spec(ckpts: dict[str, Path]) -> None:
    types = {n: json.loads((p / "config.json").read_text())["model_type"] for n, p in ckpts.items()}
    assert types == {"tiny": "mixfleet", "tiny-qwen3": "qwen3", "tiny-qwen3-moe": "qwen3_moe"}
    cfg, t = load_checkpoint(ckpts["tiny-qwen3-moe"])
    assert cfg.is_moe and cfg.qk_norm and (cfg.num_experts, cfg.num_experts_per_tok) == (8, 2)
    assert t["model.layers.3.mlp.gate.weight"].shape == (8, 256)
    assert t["model.layers.0.mlp.experts.7.down_proj.weight"].shape == (256, 256)
    assert t["model.layers.0.self_attn.q_norm.weight"].shape == (64,)
    assert not any(".mlp.gate_proj." in k for k in t)
    assert (ckpts["tiny-qwen3-moe"] / "tokenizer.json").exists()
    # spec -> config -> spec is the identity on the architecture
    spec = load_model_spec("tiny-qwen3-moe")
    back = cfg.to_spec(spec.name)
    for f in ("kind", "num_layers", "hidden_size", "num_kv_heads", "ffn_hidden_size", "rope_theta", "qk_norm", "moe"):
        assert getattr(back, f) == getattr(spec, f), f


@pytest.mark.parametrize("name,cls", [("tiny-qwen3", "Qwen3ForCausalLM"), ("tiny-qwen3-moe", "Qwen3MoeForCausalLM")])
def test_transformers_loads_the_checkpoint_exactly(ckpts: dict[str, Path], name: str, cls: str) -> None:
    """HF's own loader (transformers 5 fuses the per-expert keys into experts.gate_up_proj / down_proj)
    reads every tensor, misses none, and holds the same values; its config has our numbers."""
    model, info = transformers.AutoModelForCausalLM.from_pretrained(ckpts[name], output_loading_info=True,
                                                                    dtype=torch.float32)
    assert type(model).__name__ == cls
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    cfg, t = load_checkpoint(ckpts[name])
    c = model.config
    assert (c.head_dim, c.num_key_value_heads, c.rms_norm_eps) == (cfg.head_dim, cfg.num_key_value_heads, 1e-6)
    assert c.rope_parameters["rope_theta"] == cfg.rope_theta == 1e6
    sd = model.state_dict()
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        assert torch.equal(sd[p + "self_attn.k_norm.weight"], t[p + "self_attn.k_norm.weight"])
        if cfg.is_moe:
            assert c.num_experts_per_tok == 2 and c.norm_topk_prob is True
            f = cfg.moe_intermediate_size
            gu, down = sd[p + "mlp.experts.gate_up_proj"], sd[p + "mlp.experts.down_proj"]
            for e in range(cfg.num_experts):
                assert torch.equal(gu[e, :f], t[p + f"mlp.experts.{e}.gate_proj.weight"])
                assert torch.equal(gu[e, f:], t[p + f"mlp.experts.{e}.up_proj.weight"])
                assert torch.equal(down[e], t[p + f"mlp.experts.{e}.down_proj.weight"])
            assert torch.equal(sd[p + "mlp.gate.weight"], t[p + "mlp.gate.weight"])
        else:
            assert torch.equal(sd[p + "mlp.up_proj.weight"], t[p + "mlp.up_proj.weight"])


def test_reads_what_transformers_saves(ckpts: dict[str, Path], tmp_path: Path) -> None:
    """transformers 5 writes `num_local_experts`, `rope_parameters`, `dtype`: load_checkpoint reads them."""
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpts["tiny-qwen3-moe"], dtype=torch.float32)
    model.save_pretrained(tmp_path / "saved")
    raw = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert "num_local_experts" in raw and "rope_parameters" in raw
    cfg, t = load_checkpoint(tmp_path / "saved")
    ours, ours_t = load_checkpoint(ckpts["tiny-qwen3-moe"])
    assert cfg == ours
    assert sorted(t) == sorted(ours_t) and all(torch.equal(t[k], ours_t[k]) for k in t)


def test_bad_specs_and_configs_are_refused() -> None:
    raw = {"name": "m", "kind": "moe", "num_layers": 1, "hidden_size": 8, "num_attention_heads": 2,
           "num_kv_heads": 1, "head_dim": 4, "ffn_hidden_size": 0, "vocab_size": 272, "max_context": 16,
           "position_embedding": "rope", "qk_norm": True,
           "moe": {"num_experts": 4, "active_experts": 2, "expert_ffn_hidden_size": 8}}
    spec = model_spec_from_dict(raw)
    assert HFConfig.from_spec(spec).model_type == "qwen3_moe"
    with pytest.raises(SpecError, match="rope_theta"):
        model_spec_from_dict({**raw, "rope_theta": -1.0})
    with pytest.raises(SpecError, match="moe.expert_ffn_hidden_size"):
        model_spec_from_dict({**raw, "moe": {**raw["moe"], "expert_ffn_hidden_size": 0}})
    with pytest.raises(ValueError, match="position_embedding = 'rope' and qk_norm = true"):
        HFConfig.from_spec(replace(spec, qk_norm=False))
    with pytest.raises(ValueError, match="shared_experts"):
        HFConfig.from_spec(replace(spec, moe=replace(spec.moe, shared_experts=1)))
    with pytest.raises(ValueError, match="model_type = 'llama'; allowed: mixfleet, qwen3, qwen3_moe"):
        HFConfig.from_json({**HFConfig.from_spec(spec).to_json(), "model_type": "llama"})
    with pytest.raises(ValueError, match="mlp_only_layers"):
        HFConfig.from_json({**HFConfig.from_spec(spec).to_json(), "mlp_only_layers": [0]})
    # the dense tiny keeps its own layout: no q_norm, learned positions
    tiny = HFConfig.from_spec(load_model_spec("tiny"))
    assert tiny.model_type == "mixfleet" and "model.embed_positions.weight" in expected_shapes(tiny)
    assert not any("q_norm" in k for k in expected_shapes(tiny))
