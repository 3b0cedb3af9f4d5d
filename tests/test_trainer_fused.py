"""The trainer's fused policy-loss step (no [B, S, V] logits: the model runs without its output layer and
the corrections' `policy_loss_from_hidden` gets the hidden states and the output weight) makes the same
update as the step through the logits and `policy_loss`, to rounding: same seed, same batch, same
loss, metrics, gradient norm and weights after the AdamW step, untied and tied output layers."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from mixfleet.costmodel.specs.model import load_model_spec
from mixfleet.runner.corrections import CorrectionBatch, CorrectionConfig
from mixfleet.runner.trainer.megatron_model import BuildOptions, ensure_parallel_state, without_output_layer
from mixfleet.runner.trainer.trainer import OptimizerConfig, OutputLayerLoss, Trainer, TrainerConfig, policy_loss_fn
from test_trainer import randomize_


def rl_batch(t: Trainer, seed: int) -> dict:
    """An off-policy batch: sampler log-probs and a top-8 record from perturbed trainer logits, prompts masked."""
    g = torch.Generator().manual_seed(seed)
    b, s, prompt, vocab = 3, 12, 3, t.spec.vocab_size
    ids = torch.randint(16, vocab, (b, s), generator=g)
    logits = t.forward_logits(ids).reshape(b * s, vocab)
    q_logp = torch.log_softmax(logits + 0.7 * torch.randn(logits.shape, generator=g), dim=-1)
    labels = torch.zeros(b, s, dtype=torch.long)
    labels[:, :-1] = ids[:, 1:]
    mask = torch.zeros(b, s)
    mask[:, prompt - 1: s - 1] = 1.0
    top_lp, top_ids = q_logp.topk(8, dim=-1)
    cb = CorrectionBatch(labels=labels.reshape(-1), advantages=torch.randn(b, generator=g).repeat_interleave(s),
                         loss_mask=mask.reshape(-1), sampler_logprobs=q_logp.gather(1, labels.reshape(-1, 1))[:, 0],
                         topk_ids=top_ids, topk_logprobs=top_lp, group_ids=torch.arange(b).repeat_interleave(s) % 2)
    return {"input_ids": ids, "correction": cb}


@pytest.mark.parametrize("tied", [False, True])
def test_fused_step_is_the_logits_step(tied: bool) -> None:
    ensure_parallel_state("cpu")
    spec = dataclasses.replace(load_model_spec("tiny"), num_layers=2)   # 2 of tiny's 4 layers: a faster test
    if tied:
        spec = dataclasses.replace(spec, name="tiny-tied", tie_embeddings=True)
    # Adam's first step is lr * g / (|g| + eps): with the default eps = 1e-8 it is a sign(g) step that turns
    # fp32 rounding noise in near-zero gradients (|g| ~ 1e-7) into differences of ~lr; eps = 1e-3 keeps the
    # update proportional to the gradient, so "the same update to rounding" is what the comparison checks
    t = Trainer(spec, TrainerConfig(optimizer=OptimizerConfig(lr=1e-3, eps=1e-3, weight_decay=0.01),
                                    build=BuildOptions(device="cpu", seed=5)))
    randomize_(t, seed=11)
    batch = rl_batch(t, seed=12)
    cfg = CorrectionConfig(method="sc_mis", chunk_size=16)
    start = copy.deepcopy(t.model.state_dict())
    calls = []
    hook = t.model.output_layer.register_forward_hook(lambda *_: calls.append(1))
    fused_fn = policy_loss_fn(cfg)
    assert isinstance(fused_fn, OutputLayerLoss)
    fused = t.train_step(batch, fused_fn)
    assert calls == []                                   # the output layer never ran: no logits were built
    after_fused = {k: v.clone() for k, v in t.model.state_dict().items() if isinstance(v, torch.Tensor)}
    t.model.load_state_dict(start)
    t.optimizer = t._make_optimizer()
    t.version = 0
    plain = t.train_step(batch, policy_loss_fn(cfg, fused=False))
    assert calls == [1]
    hook.remove()
    assert fused["version"] == plain["version"] == 1 and fused["skipped"] == 0
    assert fused["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-5) and fused["grad_norm"] > 1e-3
    for key, value in plain.items():
        if key != "step_s":
            assert fused[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    moved = 0.0
    for name, value in t.model.state_dict().items():
        if not (isinstance(value, torch.Tensor) and value.is_floating_point()):
            continue
        torch.testing.assert_close(after_fused[name], value, rtol=0, atol=1e-6, msg=name)
        moved = max(moved, float((value - start[name]).abs().max()))
    assert moved > 5e-4                                  # the step moved the weights (lr 1e-3, |g| up to ~0.3)


def test_without_output_layer_restores_the_model() -> None:
    ensure_parallel_state("cpu")
    spec = dataclasses.replace(load_model_spec("tiny"), num_layers=1)
    t = Trainer(spec, TrainerConfig(build=BuildOptions(device="cpu")))
    ids = torch.randint(0, t.spec.vocab_size, (2, 5))
    hidden, weight = t._forward_hidden(ids, None, None)
    assert hidden.shape == (10, t.spec.hidden_size) and weight.shape == (t.spec.vocab_size, t.spec.hidden_size)
    logits = t.forward_logits(ids)
    torch.testing.assert_close((hidden @ weight.T).reshape(2, 5, -1), logits, rtol=1e-5, atol=1e-5)
    assert t.model.post_process
    with pytest.raises(RuntimeError, match="boom"), without_output_layer(t.model):
        raise RuntimeError("boom")
    assert t.model.post_process                          # restored after an error too
