"""The samplers' routing record reaches the trainer aligned: engine -> HTTP -> agent episode -> batch -> trainer.

A trainer-exported tiny Qwen3-MoE is served by the embedded engine over its SGLang-protocol server (started
with routed-experts recording); multi-turn episodes run through the real agent loop with the orchestrator's
response conversion; the batch goes to the trainer's train step. With an fp32 engine both sides compute the
same routing, so the trainer's disagreement must be (nearly) zero: an off-by-one position, a transposed
token order or a wrong layer order would make it ~100%. A bf16 engine's experts differ on some tokens.
"""

from __future__ import annotations

import asyncio
import math
import warnings
from pathlib import Path

import pytest
import torch

warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*")

from mixfleet.costmodel.specs.model import load_model_spec  # noqa: E402
from mixfleet.runner.orchestration.batching import BatchItem, build_batch  # noqa: E402
from mixfleet.runner.orchestration.rollouts import result_from_response, routed_shape  # noqa: E402
from mixfleet.runner.rollout.agent import AgentConfig, run_episode  # noqa: E402
from mixfleet.runner.rollout.tasks import make_task  # noqa: E402
from mixfleet.runner.sampler.client import SamplerClient  # noqa: E402
from mixfleet.runner.sampler.engine import Engine  # noqa: E402
from mixfleet.runner.sampler.engine_api import SamplingParams  # noqa: E402
from mixfleet.runner.sampler.server import ServerArgs  # noqa: E402
from mixfleet.runner.sampler.server_launch import start_in_thread  # noqa: E402
from mixfleet.runner.trainer.megatron_model import BuildOptions  # noqa: E402
from mixfleet.runner.trainer.trainer import Trainer, TrainerConfig  # noqa: E402


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> tuple[Trainer, Path]:
    spec = load_model_spec("tiny-qwen3-moe")
    trainer = Trainer(spec, TrainerConfig(build=BuildOptions(device="cpu", seed=31)))
    g = torch.Generator().manual_seed(32)
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g) if p.ndim == 1
                    else torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
    return trainer, trainer.export_hf(tmp_path_factory.mktemp("moe_e2e") / "hf", version=2)


def episodes(path: Path, precision: str, n: int = 3) -> list:
    shape = routed_shape(str(path))
    assert shape == (4, 2)
    engine = Engine(path, precision=precision, kv_cache_dtype="fp32" if precision == "fp32" else "bf16",
                    kernel="fp32", enable_return_routed_experts=True, seed=0)
    handle = start_in_thread(engine, server_args=ServerArgs(port=0))
    try:
        async def go() -> list:
            async with SamplerClient(handle.url) as client:
                async def generate(ids: list[int], params: SamplingParams, session_id: str):
                    body = {"max_new_tokens": params.max_new_tokens, "temperature": params.temperature,
                            "stop_token_ids": list(params.stop_token_ids), "sampling_seed": params.sampling_seed}
                    resp = await client.generate_ids(ids, body, return_routed_experts=True, routing_key=session_id)
                    return result_from_response(resp, routed_shape=shape)

                cfg = AgentConfig(sampling=SamplingParams(max_new_tokens=12, temperature=1.0, sampling_seed=5),
                                  max_turns=3)
                return list(await asyncio.gather(*[run_episode(make_task("guess"), s, generate, config=cfg,
                                                               group_id="g")
                                                   for s in range(n)]))
        return asyncio.run(go())
    finally:
        handle.stop()


def nll(logits: torch.Tensor, batch: dict) -> tuple[torch.Tensor, dict]:
    lp = torch.log_softmax(logits.reshape(-1, logits.shape[-1]), -1).gather(-1, batch["labels"][:, None])[:, 0]
    m = batch["loss_mask"].to(lp.dtype)
    return -(lp * m).sum() / m.sum(), {}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_sampler_routing_reaches_the_trainer_aligned(exported, precision: str) -> None:
    trainer, path = exported
    eps = episodes(path, precision)
    assert all(e.error is None for e in eps), [e.error for e in eps]
    assert max(e.num_turns for e in eps) >= 2                        # multi-turn: tool output / nudge in between
    for e in eps:
        r = e.routed_experts
        assert r is not None and r.shape == (len(e.tokens), 4, 2)
        assert (r[:-1] >= 0).all() and (r[-1] == -1).all()           # every forwarded position; not the last token
    batch = build_batch([BatchItem(episode=e, prompt_id=i) for i, e in enumerate(eps)], trained_version=3,
                        group_names=("g",))
    with torch.no_grad():
        before = {k: v.clone() for k, v in trainer.model.state_dict().items() if torch.is_tensor(v)}
    m = trainer.train_step(batch.tensors, nll)
    trainer.model.load_state_dict(before, strict=False)              # leave the module fixture's weights as they were
    trainer.version -= 1
    assert m["routing_tokens"] == batch.num_tokens > 0
    if precision == "fp32":
        assert m["routing_token_share"] <= 0.02, m                      # seen: 0.0
        assert m["group/0/routing_token_share"] == m["routing_token_share"]
    else:
        assert m["routing_layer_share"] <= m["routing_token_share"] <= 1.0
