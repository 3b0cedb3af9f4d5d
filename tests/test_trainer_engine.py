"""The trainer and the embedded sampler engine agree on the same exported weights.

The trainer exports its weights in the HF layout; the engine (runner/engine) loads them and generates
with `return_logprob`. The trainer's per-token log-probs of the very tokens the engine sampled must
equal the engine's recorded log-probs: to float32 rounding for the fp32 engine; for the bf16 engine,
within bf16's own rounding noise, measured on the spot as the trainer's fp32 log-probs vs the same
trainer under bf16 autocast (seen here: engine mean |dlogp| 0.012, max 0.048; autocast 0.011 / 0.040),
plus absolute caps. This is the export/load round trip that the off-policy corrections take for
granted (sampler and trainer see the same policy): a layout error moves log-probs by whole nats.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest
import torch

warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*")

from mixfleet.costmodel.specs.model import load_model_spec  # noqa: E402
from mixfleet.runner.sampler.engine import Engine  # noqa: E402
from mixfleet.runner.sampler.engine_api import EngineRequest, RequestResult, SamplingParams  # noqa: E402
from mixfleet.runner.trainer.megatron_model import BuildOptions  # noqa: E402
from mixfleet.runner.trainer.trainer import Trainer, TrainerConfig  # noqa: E402

PROMPTS = ([4, 40, 41, 42, 43, 5], [4, 100, 101, 102, 103, 104, 105, 106, 107, 5], [1, 200, 5])
NEW_TOKENS = 24
FP32_MAX_ABS = 1e-4
# bf16 engine (weights, activations, KV in bf16; logits/softmax fp32) vs the trainer's own bf16 noise
BF16_MEAN_FACTOR, BF16_MAX_FACTOR = 2.0, 3.0
BF16_MEAN_ABS, BF16_MAX_ABS = 0.03, 0.15


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> tuple[Trainer, Path]:
    spec = load_model_spec("tiny")
    trainer = Trainer(spec, TrainerConfig(build=BuildOptions(device="cpu", seed=21)))
    g = torch.Generator().manual_seed(22)
    with torch.no_grad():   # weights far from init so that the policy is not near-uniform
        for p in trainer.model.parameters():
            if p.ndim == 1:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
    out = trainer.export_hf(tmp_path_factory.mktemp("trainer_engine") / "hf", version=3)
    return trainer, out


def generate(engine: Engine) -> list[RequestResult]:
    done: list[RequestResult] = []
    for i, prompt in enumerate(PROMPTS):
        params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0, ignore_eos=True, sampling_seed=100 + i)
        engine.add_request(EngineRequest(rid=f"r{i}", input_ids=list(prompt), params=params, return_logprob=True),
                           on_finish=done.append)
    for _ in range(10 * NEW_TOKENS):
        if len(done) == len(PROMPTS):
            break
        engine.step()
    assert len(done) == len(PROMPTS)
    return sorted(done, key=lambda r: r.rid)


def differences(trainer: Trainer, results: list[RequestResult], *, bf16_autocast: bool = False) -> torch.Tensor:
    """|trainer log-prob - engine log-prob| of every generated token (or, with bf16_autocast, the
    trainer's fp32 log-probs vs its own bf16-autocast ones on the same tokens)."""
    diffs = []
    for prompt, res in zip(PROMPTS, results, strict=True):
        assert len(res.output_ids) == NEW_TOKENS and res.weight_version == "3"
        ids = torch.tensor([list(prompt) + res.output_ids])
        mine = trainer.token_logprobs(ids)[0, len(prompt) - 1:]          # log p of each generated token
        if bf16_autocast:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                theirs = trainer.token_logprobs(ids)[0, len(prompt) - 1:]
        else:
            theirs = torch.tensor([t.logprob for t in res.tokens], dtype=torch.float32)
        diffs.append((mine - theirs).abs())
    return torch.cat(diffs)


def test_trainer_logprobs_equal_fp32_engine(exported) -> None:
    trainer, path = exported
    engine = Engine(path, precision="fp32", kv_cache_dtype="fp32", kernel="fp32")
    d = differences(trainer, generate(engine))
    assert d.max().item() < FP32_MAX_ABS, d.max().item()


def test_trainer_logprobs_match_bf16_engine_within_bf16_rounding(exported) -> None:
    trainer, path = exported
    results = generate(Engine(path, precision="bf16", kv_cache_dtype="bf16"))
    d = differences(trainer, results)
    noise = differences(trainer, results, bf16_autocast=True)
    print(f"bf16 engine vs trainer |dlogp|: mean {d.mean().item():.4f}, max {d.max().item():.4f}; "
          f"trainer bf16 autocast noise: mean {noise.mean().item():.4f}, max {noise.max().item():.4f}")
    assert noise.mean().item() > 0       # the noise floor is real (autocast did run in bf16)
    assert d.mean().item() < min(BF16_MEAN_ABS, BF16_MEAN_FACTOR * noise.mean().item()), (d.mean(), noise.mean())
    assert d.max().item() < min(BF16_MAX_ABS, BF16_MAX_FACTOR * noise.max().item()), (d.max(), noise.max())
    lp = torch.tensor([t.logprob for r in results for t in r.tokens])
    assert lp.std().item() > 0.1     # a non-degenerate policy: the comparison is not of near-constants
