"""The Megatron-core trainer on the Qwen3 layouts (RoPE, QK-norm, MoE) on CPU, judged by HF transformers.

Hugging Face `transformers` (the test extra) builds its own Qwen3ForCausalLM / Qwen3MoeForCausalLM from
the checkpoint the trainer exports (config.json + safetensors, HF's names, no download) and is the
independent reference: in fp32 its logits and its chosen experts per token must match the trainer's.
Also: the export -> import round trip is exact, and routing replay / disagreement behave as documented.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest
import torch

warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*")

transformers = pytest.importorskip("transformers")

from mixfleet.costmodel.specs.model import load_model_spec  # noqa: E402
from mixfleet.runner.checkpoint.hf_checkpoint import load_checkpoint  # noqa: E402
from mixfleet.runner.trainer.hf_export import hf_to_megatron, megatron_to_hf  # noqa: E402
from mixfleet.runner.trainer.megatron_model import BuildOptions  # noqa: E402
from mixfleet.runner.trainer.routing import disagreement  # noqa: E402
from mixfleet.runner.trainer.trainer import OptimizerConfig, Trainer, TrainerConfig  # noqa: E402

SEQ = 40


def randomize_(trainer: Trainer, seed: int) -> None:
    """Distinct random values in every weight (norms around 1), so no mapping error can hide."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in trainer.model.parameters():
            if p.ndim == 1:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))


@pytest.fixture(scope="module", params=["tiny-qwen3", "tiny-qwen3-moe"])
def trained(request, tmp_path_factory) -> tuple[Trainer, Path]:
    spec = load_model_spec(request.param)
    t = Trainer(spec, TrainerConfig(build=BuildOptions(device="cpu", seed=1)))
    randomize_(t, seed=7)
    out = t.export_hf(tmp_path_factory.mktemp(request.param) / "hf", version=3)
    return t, out


def hf_model(path: Path, moe: bool) -> torch.nn.Module:
    cls = transformers.Qwen3MoeForCausalLM if moe else transformers.Qwen3ForCausalLM
    return cls.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager").eval()


def test_hf_transformers_matches_trainer(trained) -> None:
    t, out = trained
    moe = t.spec.kind == "moe"
    ids = torch.randint(0, t.spec.vocab_size, (3, SEQ), generator=torch.Generator().manual_seed(1))
    hf = hf_model(out, moe)
    assert type(hf).__name__ == ("Qwen3MoeForCausalLM" if moe else "Qwen3ForCausalLM")
    with torch.no_grad():
        res = hf(ids, output_router_logits=moe)
    got = t.forward_logits(ids)
    err = (got - res.logits).abs().max().item()
    assert err < 1e-4 * max(1.0, res.logits.abs().max().item()), err      # seen: 4e-6 at |logit| ~ 4.4
    if moe:
        k = t.spec.moe.active_experts
        theirs = torch.stack([r.reshape(3, SEQ, -1).topk(k, dim=-1).indices for r in res.router_logits], dim=2)
        mine = t.last_routing
        assert mine is not None and mine.shape == theirs.shape == (3, SEQ, t.spec.num_layers, k)
        assert torch.equal(mine.sort(-1).values, theirs.sort(-1).values)
        assert len(set(mine.flatten().tolist())) == t.spec.moe.num_experts    # every expert is used somewhere
    else:
        assert t.last_routing is None


def test_export_import_round_trip_exact(trained) -> None:
    t, out = trained
    cfg, tensors = load_checkpoint(out)
    assert cfg.model_type == ("qwen3_moe" if t.spec.kind == "moe" else "qwen3") and cfg.weight_version == "3"
    if t.spec.kind == "moe":
        assert {"model.layers.3.mlp.experts.7.down_proj.weight", "model.layers.0.mlp.gate.weight"} <= tensors.keys()
    assert "model.layers.0.self_attn.q_norm.weight" in tensors
    back = megatron_to_hf(hf_to_megatron(tensors, cfg, padded_vocab_size=t.padded_vocab_size), cfg)
    assert back.keys() == tensors.keys() and all(torch.equal(back[k], tensors[k]) for k in tensors)
    state = {k: v for k, v in t.model.state_dict().items() if not k.endswith("_extra_state")}
    again = hf_to_megatron(tensors, cfg, padded_vocab_size=t.padded_vocab_size)
    vocab = t.spec.vocab_size
    for k, v in state.items():
        if k in ("embedding.word_embeddings.weight", "output_layer.weight"):
            assert torch.equal(again[k][:vocab], v[:vocab]), k
        else:
            assert torch.equal(again[k], v), k
    t2 = Trainer.from_checkpoint(out, TrainerConfig(build=BuildOptions(device="cpu", seed=99)))
    assert t2.version == 3 and t2.spec.qk_norm and t2.spec.rope_theta == t.spec.rope_theta
    ids = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(2))
    assert torch.equal(t2.forward_logits(ids), t.forward_logits(ids))


def test_routing_replay_and_disagreement(tmp_path: Path) -> None:
    spec = load_model_spec("tiny-qwen3-moe")
    free = Trainer(spec, TrainerConfig(build=BuildOptions(device="cpu", seed=4)))
    randomize_(free, seed=5)
    path = free.export_hf(tmp_path / "hf")
    replay = Trainer.from_checkpoint(path, TrainerConfig(routing="replay", build=BuildOptions(device="cpu")))
    ids = torch.randint(0, spec.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))
    base = free.forward_logits(ids)
    own = free.last_routing
    # replaying the trainer's own experts changes nothing; no record (-1) means route freely
    assert torch.equal(replay.forward_logits(ids, routed_experts=own), base)
    assert torch.equal(replay.forward_logits(ids, routed_experts=torch.full_like(own, -1)), base)
    # other experts in layer 0 of every token: the logits move, and the free trainer ignores the record
    other = own.clone()
    other[:, :, 0] = (own[:, :, 0] + 1) % spec.moe.num_experts
    assert not torch.allclose(replay.forward_logits(ids, routed_experts=other), base)
    assert torch.equal(replay.last_routing[:, :, 0], own[:, :, 0])            # its own choice stays recorded
    assert torch.equal(free.forward_logits(ids, routed_experts=other), base)
    # disagreement: every token differs in exactly layer 0 of 4 -> token share 1, layer share 1/4
    mask = torch.ones(2 * 12, dtype=torch.bool)
    groups = torch.tensor([0] * 12 + [2] * 12)
    d = disagreement(own.reshape(24, 4, 2), other.reshape(24, 4, 2), mask, groups)
    assert d["routing_token_share"] == 1.0 and d["routing_layer_share"] == 0.25 and d["routing_tokens"] == 24
    assert d["group/0/routing_tokens"] == 12 and d["group/2/routing_layer_share"] == 0.25
    same = disagreement(own.reshape(24, 4, 2), own.flip(-1).reshape(24, 4, 2), mask)     # sets, not order
    assert same["routing_token_share"] == 0.0


def test_moe_train_step_reports_routing_and_learns() -> None:
    spec = load_model_spec("tiny-qwen3-moe")
    for mode in ("free", "replay"):
        t = Trainer(spec, TrainerConfig(optimizer=OptimizerConfig(lr=3e-3), routing=mode,
                                        build=BuildOptions(device="cpu", seed=6)))
        ids = torch.randint(16, spec.vocab_size, (2, 16), generator=torch.Generator().manual_seed(4))
        t.forward_logits(ids)
        sampler = t.last_routing.clone()
        sampler[1, :, 2] = (sampler[1, :, 2] + 3) % spec.moe.num_experts     # row 1 differs in layer 2
        mask = torch.zeros(2, 16, dtype=torch.bool)
        mask[:, 4:15] = True

        def nll(logits: torch.Tensor, batch: dict) -> tuple[torch.Tensor, dict]:
            lp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
            return -lp.mean(), {}

        batch = {"input_ids": ids, "loss_mask": mask.reshape(-1), "routed_experts": sampler.reshape(32, 4, 2),
                 "group_ids": torch.tensor([0] * 16 + [1] * 16)}
        m = [t.train_step(batch, nll) for _ in range(3)]
        assert m[-1]["loss"] < m[0]["loss"]
        assert m[0]["routing_tokens"] == 22 and m[0]["group/0/routing_token_share"] == 0.0
        assert m[0]["group/1/routing_token_share"] == 1.0
        if mode == "free":        # only layer 2 differs; replaying it moves layer 3's input too, so >= 1 of 4
            assert m[0]["group/1/routing_layer_share"] == 0.25
        else:
            assert 0.25 <= m[0]["group/1/routing_layer_share"] <= 0.5
        grads_seen = t.model.decoder.layers[0].mlp.router.weight
        assert torch.isfinite(grads_seen).all()


def test_routing_mode_is_checked() -> None:
    with pytest.raises(ValueError, match="routing.*allowed: free, replay"):
        TrainerConfig(routing="sticky")


def test_hf_transformers_gradients_match_trainer(trained) -> None:
    """The backward pass too (issue 23: the MoE did not learn where the dense model did): the gradient of the summed
    next-token log-probs w.r.t. every weight family (router, experts or MLP, attention, embedding, output) matches
    HF transformers' autograd through its own model, norm by norm."""
    t, out = trained
    moe = t.spec.kind == "moe"
    ids = torch.randint(0, t.spec.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(3))
    t.model.train()
    t.model.zero_grad(set_to_none=True)
    logits = t._forward(ids, None, None)
    torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).sum().backward()
    mine = {n: p.grad for n, p in t.model.named_parameters()}
    hf = hf_model(out, moe).train()
    hf_logits = hf(ids).logits
    torch.log_softmax(hf_logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).sum().backward()
    theirs = {n: p.grad for n, p in hf.named_parameters()}
    assert all(g is not None for g in mine.values()), [n for n, g in mine.items() if g is None]

    def norm(grads: dict, pick) -> float:
        return math.sqrt(sum(float(g.pow(2).sum()) for n, g in grads.items() if pick(n) and g is not None))

    families = [("attention", lambda n: "self_attention.linear" in n,
                 lambda n: any(k in n for k in ("q_proj", "k_proj", "v_proj", "o_proj"))),
                ("embedding", lambda n: "embedding" in n, lambda n: "embed_tokens" in n),
                ("output", lambda n: "output_layer" in n, lambda n: "lm_head" in n)]
    if moe:
        families += [("router", lambda n: "router" in n, lambda n: "mlp.gate.weight" in n),
                     ("experts", lambda n: "experts" in n, lambda n: "experts" in n)]
    else:
        families += [("mlp", lambda n: "mlp.linear_fc" in n,
                      lambda n: any(k in n for k in ("gate_proj", "up_proj", "down_proj")))]
    for name, pick_mine, pick_theirs in families:
        a, b = norm(mine, pick_mine), norm(theirs, pick_theirs)
        assert b > 0, name
        assert a == pytest.approx(b, rel=1e-4), (name, a, b)
    t.model.zero_grad(set_to_none=True)
