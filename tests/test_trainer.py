"""Tests of the Megatron-core trainer (runner/trainer): build, forward/backward, HF export layout,
round trip, training progress, resumable state, and clear errors. CPU, gloo world size 1, tiny model.

The reference forward below is written from `runner/checkpoint/hf_checkpoint.py`'s docstring only (not from
Megatron), in float64, so agreeing with it pins the export layout (QKV interleave, gate/up order,
norm mapping, vocabulary padding) that every sampler relies on.
"""

from __future__ import annotations

import dataclasses
import math
import os
import warnings
from pathlib import Path

import pytest
import torch

warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*")

from mixfleet.costmodel.specs.model import load_model_spec  # noqa: E402
from mixfleet.runner.checkpoint.hf_checkpoint import HFConfig, load_checkpoint  # noqa: E402
from mixfleet.runner.trainer.hf_export import fuse_qkv, hf_to_megatron, megatron_to_hf, split_qkv  # noqa: E402
from mixfleet.runner.trainer.megatron_model import BuildOptions, ensure_parallel_state  # noqa: E402
from mixfleet.runner.trainer.trainer import OptimizerConfig, Trainer, TrainerConfig  # noqa: E402

SEQ = 24


def nll_loss(logits: torch.Tensor, batch: dict) -> tuple[torch.Tensor, dict]:
    """Mean next-token negative log-likelihood (a simple supervised loss for the tests)."""
    ids = batch["input_ids"]
    lp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
    loss = -lp.mean()
    return loss, {"nll": loss.detach()}


def reference_forward(cfg: HFConfig, w: dict[str, torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    """The forward pass of the hf_checkpoint docstring, float64, written independently of Megatron."""
    w = {k: v.double() for k, v in w.items()}
    b, s = ids.shape
    heads, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim

    def rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return weight * x / torch.sqrt((x * x).mean(-1, keepdim=True) + cfg.rms_norm_eps)

    x = w["model.embed_tokens.weight"][ids] + w["model.embed_positions.weight"][torch.arange(s)]
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        n = rms(x, w[p + "input_layernorm.weight"])
        q = (n @ w[p + "self_attn.q_proj.weight"].T).view(b, s, heads, d)
        k = (n @ w[p + "self_attn.k_proj.weight"].T).view(b, s, kv, d)
        v = (n @ w[p + "self_attn.v_proj.weight"].T).view(b, s, kv, d)
        outs = []
        for j in range(heads):
            g = j // (heads // kv)
            scores = torch.einsum("bqd,bkd->bqk", q[:, :, j], k[:, :, g]) / math.sqrt(d)
            scores = scores.masked_fill(~causal, float("-inf"))
            outs.append(torch.softmax(scores, -1) @ v[:, :, g])
        h = x + torch.cat(outs, dim=-1) @ w[p + "self_attn.o_proj.weight"].T
        n = rms(h, w[p + "post_attention_layernorm.weight"])
        mlp = torch.nn.functional.silu(n @ w[p + "mlp.gate_proj.weight"].T) * (n @ w[p + "mlp.up_proj.weight"].T)
        x = h + mlp @ w[p + "mlp.down_proj.weight"].T
    return rms(x, w["model.norm.weight"]) @ w["lm_head.weight"].T


def randomize_(trainer: Trainer, seed: int) -> None:
    """Give every weight (norms included, vocab padding rows included) distinct random values."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in trainer.model.parameters():
            if p.ndim == 1:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))


@pytest.fixture(scope="module")
def spec():
    ensure_parallel_state("cpu")
    ensure_parallel_state("cpu")   # idempotent: a second call is a no-op
    return load_model_spec("tiny")


@pytest.fixture(scope="module")
def trainer(spec) -> Trainer:
    t = Trainer(spec, TrainerConfig(build=BuildOptions(device="cpu", seed=1)))
    randomize_(t, seed=7)
    return t


def test_build_forward_backward(spec, trainer: Trainer) -> None:
    assert trainer.device == "cpu" and trainer.padded_vocab_size == 384
    ids = torch.randint(0, spec.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(0))
    logits = trainer.forward_logits(ids)
    assert logits.shape == (2, SEQ, spec.vocab_size) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    trainer.model.train()
    loss, _ = nll_loss(trainer._forward(ids, None, None), {"input_ids": ids})
    loss.backward()
    grads = {n: p.grad for n, p in trainer.model.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    assert grads["decoder.layers.0.self_attention.linear_qkv.weight"].abs().sum() > 0
    assert grads["decoder.layers.3.mlp.linear_fc1.weight"].abs().sum() > 0
    # padding rows of the output layer never reach the loss
    assert grads["output_layer.weight"][spec.vocab_size:].abs().sum() == 0
    trainer.model.zero_grad(set_to_none=True)


def test_megatron_forward_matches_reference_on_exported_weights(spec, trainer: Trainer, tmp_path: Path) -> None:
    out = trainer.export_hf(tmp_path / "hf", version=5)
    cfg, w = load_checkpoint(out)
    assert cfg.weight_version == "5" and (out / "tokenizer.json").exists()
    ids = torch.randint(0, spec.vocab_size, (3, SEQ), generator=torch.Generator().manual_seed(1))
    ref = reference_forward(cfg, w, ids)
    got = trainer.forward_logits(ids).double()
    assert ref.shape == got.shape
    err = (got - ref).abs().max().item()
    assert err < 2e-5 * max(1.0, ref.abs().max().item()), err   # seen: 5e-6 at |logit| ~ 4
    # the check has teeth: swapping gate and up (a plausible layout bug) moves the logits a lot
    bad = dict(w)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}.mlp."
        bad[p + "gate_proj.weight"], bad[p + "up_proj.weight"] = w[p + "up_proj.weight"], w[p + "gate_proj.weight"]
    assert (reference_forward(cfg, bad, ids) - got).abs().max().item() > 100 * err + 1e-3


def test_split_qkv_undoes_the_per_group_interleave() -> None:
    heads, kv, d, hidden = 6, 2, 3, 1
    # Megatron order per group g: q heads (3 of them), k, v; encode (group, slot, dim) in the value
    rows = [[100 * g + 10 * slot + e] for g in range(kv) for slot in range(heads // kv + 2) for e in range(d)]
    fused = torch.tensor(rows, dtype=torch.float32).reshape(-1, hidden)
    q, k, v = split_qkv(fused, heads=heads, kv_heads=kv, head_dim=d)
    qpg = heads // kv
    expect_q = [100 * (j // qpg) + 10 * (j % qpg) + e for j in range(heads) for e in range(d)]
    assert q[:, 0].tolist() == expect_q
    assert k[:, 0].tolist() == [100 * g + 10 * qpg + e for g in range(kv) for e in range(d)]
    assert v[:, 0].tolist() == [100 * g + 10 * (qpg + 1) + e for g in range(kv) for e in range(d)]
    assert torch.equal(fuse_qkv(q, k, v, heads=heads, kv_heads=kv, head_dim=d), fused)


def test_export_import_round_trip_is_exact(spec, trainer: Trainer, tmp_path: Path) -> None:
    out = trainer.export_hf(tmp_path / "hf")
    other = Trainer.from_checkpoint(out, TrainerConfig(build=BuildOptions(device="cpu", seed=99)))
    assert other.version == trainer.version
    a, b = trainer.hf_state(), other.hf_state()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    mine, theirs = trainer.model.state_dict(), other.model.state_dict()
    for name, t in mine.items():
        if not isinstance(t, torch.Tensor):
            continue
        if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            assert torch.equal(theirs[name][: spec.vocab_size], t[: spec.vocab_size])
            assert theirs[name][spec.vocab_size:].abs().sum() == 0   # import zero-pads
        else:
            assert torch.equal(theirs[name], t), name
    ids = torch.randint(0, spec.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(2))
    assert torch.equal(trainer.forward_logits(ids), other.forward_logits(ids))
    # and the pure conversion functions are inverse on the HF side
    cfg = trainer.hf_config()
    again = megatron_to_hf(hf_to_megatron(a, cfg, padded_vocab_size=384), cfg)
    assert all(torch.equal(again[k], a[k]) for k in a)


def test_packed_rows_equal_separate_rows(spec, trainer: Trainer) -> None:
    g = torch.Generator().manual_seed(3)
    first, second = torch.randint(0, spec.vocab_size, (1, 10), generator=g), torch.randint(0, spec.vocab_size,
                                                                                           (1, 14), generator=g)
    packed = torch.cat([first, second], dim=1)
    seg = torch.tensor([[0] * 10 + [1] * 14])
    got = trainer.forward_logits(packed, segment_ids=seg)
    assert torch.allclose(got[:, :10], trainer.forward_logits(first), atol=1e-5, rtol=0)
    assert torch.allclose(got[:, 10:], trainer.forward_logits(second), atol=1e-5, rtol=0)
    lp = trainer.token_logprobs(packed)
    assert lp.shape == (1, 23) and (lp <= 0).all()


def test_train_steps_reduce_the_loss_on_a_fixed_batch(spec) -> None:
    opt = OptimizerConfig(lr=3e-3, weight_decay=0.01, grad_clip_norm=1.0)
    t = Trainer(spec, TrainerConfig(optimizer=opt, build=BuildOptions(device="cpu", seed=3)))
    batch = {"input_ids": torch.randint(0, spec.vocab_size, (4, SEQ), generator=torch.Generator().manual_seed(4))}
    metrics = [t.train_step(batch, nll_loss) for _ in range(6)]
    losses = [m["loss"] for m in metrics]
    assert losses[-1] < losses[0] - 0.5, losses
    assert [m["version"] for m in metrics] == [1, 2, 3, 4, 5, 6]
    assert all(m["grad_norm"] > 0 and m["skipped"] == 0 and m["nll"] == m["loss"] for m in metrics)


def test_nonfinite_gradient_skips_the_step(spec) -> None:
    t = Trainer(spec, TrainerConfig(build=BuildOptions(device="cpu", seed=5)))
    before = {k: v.clone() for k, v in t.hf_state().items()}
    batch = {"input_ids": torch.zeros(1, 8, dtype=torch.long)}
    m = t.train_step(batch, lambda logits, b: (logits.sum() * float("nan"), {}))
    assert m["skipped"] == 1 and t.version == 0
    after = t.hf_state()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_save_and_resume_is_bit_exact(spec, tmp_path: Path) -> None:
    opt = OptimizerConfig(lr=1e-3, weight_decay=0.1, warmup_steps=3)
    cfg = TrainerConfig(optimizer=opt, build=BuildOptions(device="cpu", seed=11))
    g = torch.Generator().manual_seed(6)
    b1, b2 = ({"input_ids": torch.randint(0, spec.vocab_size, (2, SEQ), generator=g)} for _ in range(2))
    a = Trainer(spec, cfg)
    a.train_step(b1, nll_loss)
    a.save_state(tmp_path / "state")
    a.save_state(tmp_path / "state")     # overwriting an existing state is atomic too
    torch.manual_seed(12345)             # the saved RNG state must be restored by resume
    ma = a.train_step(b2, nll_loss)
    rng_a = torch.rand(3)
    b = Trainer.resume(tmp_path / "state")
    assert b.version == 1
    mb = b.train_step(b2, nll_loss)
    torch.manual_seed(12345)
    rng_b = torch.rand(3)
    assert torch.equal(rng_a, rng_b)
    assert (ma["loss"], ma["grad_norm"], ma["lr"], ma["version"]) == (mb["loss"], mb["grad_norm"], mb["lr"],
                                                                      mb["version"])
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa if isinstance(sa[k], torch.Tensor))
    oa, ob = a.optimizer.state_dict()["state"], b.optimizer.state_dict()["state"]
    assert all(torch.equal(oa[i]["exp_avg_sq"], ob[i]["exp_avg_sq"]) for i in oa)


def test_interrupted_save_leaves_the_previous_state(spec, tmp_path: Path, monkeypatch) -> None:
    t = Trainer(spec, TrainerConfig(build=BuildOptions(device="cpu", seed=13)))
    t.save_state(tmp_path / "state")
    t.version = 42

    def dies_mid_write(obj, f, *a, **k):
        Path(f).write_bytes(b"half a checkpoint")
        raise KeyboardInterrupt("killed")

    monkeypatch.setattr(torch, "save", dies_mid_write)
    with pytest.raises(KeyboardInterrupt):
        t.save_state(tmp_path / "state")
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state"]   # no temp folder left behind
    t.load_state(tmp_path / "state")
    assert t.version == 0


def test_clear_errors(spec, trainer: Trainer, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="qk_norm = true with position_embedding = 'learned_absolute'"):
        Trainer(dataclasses.replace(spec, qk_norm=True), TrainerConfig(build=BuildOptions(device="cpu")))
    with pytest.raises(ValueError, match="B parameters on CPU"):      # the 35B MoE: refused before allocating
        Trainer(load_model_spec("qwen3.6-35b-a3b"), TrainerConfig(build=BuildOptions(device="cpu")))
    with pytest.raises(ValueError, match="max_context"):
        trainer.forward_logits(torch.zeros(1, spec.max_context + 1, dtype=torch.long))
    with pytest.raises(ValueError, match="vocabulary"):
        trainer.forward_logits(torch.full((1, 4), spec.vocab_size))
    with pytest.raises(ValueError, match="lr"):
        OptimizerConfig(lr=0)
    with pytest.raises(ValueError, match="betas"):
        OptimizerConfig(betas=(0.9, 1.5))
    with pytest.raises(ValueError, match="export_dtype"):
        TrainerConfig(export_dtype="int8")
    with pytest.raises(ValueError, match="device"):
        BuildOptions(device="tpu")
    with pytest.raises(FileNotFoundError, match="save_state"):
        trainer.load_state(tmp_path)
    small = dataclasses.replace(spec, num_layers=2)
    trainer.export_hf(tmp_path / "hf")
    t2 = Trainer(small, TrainerConfig(build=BuildOptions(device="cpu")))
    with pytest.raises(ValueError, match="does not match"):
        t2.load_hf(tmp_path / "hf")


def test_corrections_policy_loss_plugs_in(spec) -> None:
    """sc_mis from the corrections module as the loss: sequences with positive advantage gain log-prob."""
    from mixfleet.runner.corrections import CorrectionBatch, CorrectionConfig
    from mixfleet.runner.trainer.trainer import policy_loss_fn

    t = Trainer(spec, TrainerConfig(optimizer=OptimizerConfig(lr=2e-3), build=BuildOptions(device="cpu", seed=17)))
    g = torch.Generator().manual_seed(8)
    b, s, prompt = 4, 16, 4
    ids = torch.randint(16, spec.vocab_size, (b, s), generator=g)
    adv_row = torch.tensor([1.0, -1.0, 1.0, -1.0])
    mask = torch.zeros(b, s)
    mask[:, prompt - 1: s - 1] = 1.0           # positions predicting the generated tokens
    labels = torch.zeros(b, s, dtype=torch.long)
    labels[:, :-1] = ids[:, 1:]
    before = t.token_logprobs(ids)
    sampler_lp = torch.zeros(b, s)
    sampler_lp[:, :-1] = before                # on-policy sampler: q == p, with its top-8 record
    top_lp, top_ids = torch.log_softmax(t.forward_logits(ids), dim=-1).reshape(b * s, -1).topk(8, dim=-1)
    cb = CorrectionBatch(labels=labels.reshape(-1), advantages=adv_row[:, None].expand(b, s).reshape(-1),
                         loss_mask=mask.reshape(-1), sampler_logprobs=sampler_lp.reshape(-1),
                         topk_ids=top_ids, topk_logprobs=top_lp,
                         group_ids=torch.arange(b).repeat_interleave(s) % 2)
    loss_fn = policy_loss_fn(CorrectionConfig(method="sc_mis"))
    for _ in range(3):
        m = t.train_step({"input_ids": ids, "correction": cb}, loss_fn)
    assert m["version"] == 3 and "k3" in m and "group/0/k3" in m
    gain = ((t.token_logprobs(ids) - before) * mask[:, :-1]).sum(dim=1)
    assert (gain[adv_row > 0] > 0).all() and (gain[adv_row < 0] < 0).all(), gain


def test_trainer_state_loads_tensors_only(tmp_path: Path) -> None:
    """A trainer_state.pt that would run code when unpickled is refused, and its code does not run."""
    import json

    from mixfleet.runner.trainer.trainer import META_FILE, STATE_FILE, STATE_FORMAT, Trainer

    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):  # noqa: ANN204
            return (os.system, (f"touch {marker}",))

    state = tmp_path / "state"
    state.mkdir()
    import torch

    torch.save({"format": STATE_FORMAT, "model": Evil()}, state / STATE_FILE)   # the real file format
    from mixfleet.costmodel.specs.model import load_model_spec

    spec = load_model_spec("tiny").to_dict()
    (state / META_FILE).write_text(json.dumps({"format": STATE_FORMAT, "version": 1, "spec": spec, "config": {}}))
    with pytest.raises(ValueError, match="tensors and plain values"):
        Trainer.resume(state)
    assert not marker.exists()
