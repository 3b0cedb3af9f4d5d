"""The two smallest CPU-safe stand-ins a CPU-only Megatron-core needs for RoPE and MoE (0.16.1).

Why: on a CPU build of torch, two Megatron-core modules call CUDA unconditionally in their forward
pass, although the maths around the call is plain torch. Each class below subclasses Megatron's own
module and overrides only the method with the CUDA call, so everything else (frequencies, top-k
routing, router replay, token dispatch, experts) stays Megatron's code:

- `CPURotaryEmbedding(RotaryEmbedding)`: `RotaryEmbedding.get_emb` moves `inv_freq` to
  `torch.cuda.current_device()` on its first call ("move inv_freq to GPU once"). The override is the
  same computation without that move. `GPTModel` builds its `rotary_pos_emb` directly (there is no
  layer-spec hook for it), so `megatron_model.build_gpt_model` swaps the attribute after the build.
- `CPUTopKRouter(TopKRouter)`: `Router.gating` moves the router weight to `torch.cuda.current_device()`
  and then calls `router_gating_linear`, whose autograd function references `te_general_gemm`, a
  name only defined when Transformer Engine imports (NameError without it). The override computes
  the same logits with `torch.nn.functional.linear` in the router dtype. Plugged in through Megatron's
  own hook, `MoESubmodules.router` of the layer spec.

`PartialRouterReplay(RouterReplay)` is not a CPU fix: it is Megatron's router replay (record the
top-k indices / replay given ones) extended in two ways the RL trainer needs on any device: it always
records the trainer's own top-k (so routing disagreement with the sampler is measurable while
replaying), and it replays per token only where the sampler's record exists (a row of -1 = no record:
the trainer routes that token itself).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction


class CPURotaryEmbedding(RotaryEmbedding):
    """Megatron's RotaryEmbedding with `get_emb` computed where `inv_freq` is (no move to CUDA)."""

    def get_emb(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        freqs = self.get_freqs_non_repeated(max_seq_len, offset)
        if not self.rotary_interleaved:
            emb = torch.cat((freqs, freqs), dim=-1)
        else:
            emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
        return emb[:, None, None, :]


class CPUTopKRouter(TopKRouter):
    """Megatron's TopKRouter with `gating` as a plain linear layer (no move to CUDA, no TE GEMM)."""

    def gating(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - Megatron's signature
        dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(self.config.moe_router_dtype or "", input.dtype)
        bias = None if self.bias is None else self.bias.to(dtype)
        return torch.nn.functional.linear(input.to(dtype), self.weight.to(dtype), bias)


TopK = Callable[..., tuple[torch.Tensor, torch.Tensor]]


class PartialRouterReplay(RouterReplay):
    """Router replay that records the router's own choice and replays only the tokens with a target.

    `target_topk_idx` [tokens, k] (Megatron's token order: sequence-major, i.e. token s * batch + b);
    a row with any index < 0 has no target and keeps the router's own top-k. The probabilities of the
    replayed experts are the router's own scores gathered at those experts (as Megatron's replay does).
    Not registered in Megatron's process-global instance list: the trainer addresses its model's
    routers directly, so several models in one process (tests, runner) never see each other's state.
    """

    def __init__(self) -> None:  # noqa: D107 - deliberately not calling RouterReplay.__init__ (global list)
        self.target_topk_idx: torch.Tensor | None = None
        self.recorded_topk_idx: torch.Tensor | None = None
        self.router_replay_action: RouterReplayAction | None = None
        self.replay_backward_list: list[torch.Tensor] = []

    def get_replay_topk(self, scores: torch.Tensor, topk: int, num_groups: int | None = None,
                        group_topk: int | None = None, default_compute_topk: TopK | None = None,
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        assert default_compute_topk is not None
        probs, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        self.recorded_topk_idx = own.detach()
        target = self.target_topk_idx
        if self.router_replay_action != RouterReplayAction.REPLAY_FORWARD or target is None:
            return probs, own
        if tuple(target.shape) != tuple(own.shape):
            raise ValueError(f"router replay: target indices {tuple(target.shape)} != the router's "
                             f"[tokens, top-k] {tuple(own.shape)}")
        target = target.to(own.device, own.dtype)
        known = (target >= 0).all(dim=-1, keepdim=True)
        idx = torch.where(known, target, own)
        return scores.gather(1, idx), idx
