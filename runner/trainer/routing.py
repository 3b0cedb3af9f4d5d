"""MoE routing in the trainer: record its experts per token, replay the sampler's, measure the difference.

Why: a MoE policy's sampler and trainer can pick different experts for the same token (different
number formats, kernels, batch shapes), a mismatch source of its own beside the token probabilities.
This module turns the per-layer routers of a built GPTModel (`megatron_model.moe_routers`, each with a
`cpu_safe.PartialRouterReplay`) into one [B, S, L, k] view, and offers:

- `trainer.routing = "free"`: the trainer routes every token itself (its experts are recorded);
- `trainer.routing = "replay"` (rollout routing replay): each token with a sampler record uses the
  sampler's experts, with the trainer's own router probabilities at those experts (Megatron's replay);
  tokens without a record (-1) are routed by the trainer.

Layout of an experts tensor: `[B, S, L, k]` int64, entry (b, t, l) = the top-k experts of input token t of
row b in layer l (sorted or not: comparisons are of sets); -1 = no record. Megatron's routers see
tokens sequence-major (token index t * B + b): `to_router_order` / `from_router_order` convert.

Disagreement (per token that a sampler generated, i.e. loss positions: the forward at input t produced
token t + 1): a layer *differs* when its top-k set differs; `token_share` = share of tokens differing in
>= 1 layer, `layer_share` = mean over tokens of the share of layers differing. Only tokens with a complete
sampler record count.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from mixfleet.policies.plan import ROUTING_MODES


def check_routing_mode(mode: str, where: str = "trainer.routing") -> str:
    if mode not in ROUTING_MODES:
        raise ValueError(f"{where} = {mode!r}; allowed: {', '.join(ROUTING_MODES)}")
    return mode


def to_router_order(experts: torch.Tensor) -> list[torch.Tensor]:
    """[B, S, L, k] -> per layer [S * B, k] in Megatron's sequence-major token order."""
    b, s, n_layers, k = experts.shape
    return [experts[:, :, i].permute(1, 0, 2).reshape(s * b, k) for i in range(n_layers)]


def from_router_order(per_layer: Sequence[torch.Tensor], b: int, s: int) -> torch.Tensor:
    """Per layer [S * B, k] -> [B, S, L, k]."""
    return torch.stack([t.reshape(s, b, -1).permute(1, 0, 2) for t in per_layer], dim=2)


def arm(routers: Sequence[Any], mode: str, target: torch.Tensor | None) -> None:
    """Before a forward: replay `target` [B, S, L, k] (mode 'replay') or route freely; always record."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    check_routing_mode(mode)
    if target is not None and target.shape[2] != len(routers):
        raise ValueError(f"routed experts have {target.shape[2]} layers; the model has {len(routers)} MoE layers")
    per_layer = to_router_order(target) if (mode == "replay" and target is not None) else [None] * len(routers)
    for router, tgt in zip(routers, per_layer, strict=True):
        rr = router.router_replay
        rr.clear_indices()
        if tgt is not None and tgt.shape[-1] != router.topk:
            raise ValueError(f"routed experts have top-{tgt.shape[-1]}; the model routes top-{router.topk}")
        rr.target_topk_idx = tgt
        rr.router_replay_action = RouterReplayAction.REPLAY_FORWARD if tgt is not None else None


def recorded(routers: Sequence[Any], b: int, s: int) -> torch.Tensor | None:
    """After a forward: the trainer's own experts [B, S, L, k] (None for a dense model)."""
    if not routers:
        return None
    per_layer = [r.router_replay.recorded_topk_idx for r in routers]
    if any(t is None for t in per_layer):
        raise RuntimeError("no routing recorded: the MoE routers did not run in the last forward")
    return from_router_order([t.to("cpu", torch.int64) for t in per_layer], b, s)


def disarm(routers: Sequence[Any]) -> None:
    for router in routers:
        router.router_replay.clear_indices()
        router.router_replay.router_replay_action = None


def layer_differs(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[..., L, k] x [..., L, k] -> [..., L] bool: the top-k sets differ."""
    return (a.sort(dim=-1).values != b.sort(dim=-1).values).any(dim=-1)


def disagreement(trainer: torch.Tensor, sampler: torch.Tensor, mask: torch.Tensor,
                 group_ids: torch.Tensor | None = None) -> dict[str, float]:
    """Token and layer disagreement over the masked tokens with a complete sampler record.

    `trainer`, `sampler`: [N, L, k] (flattened B * S, aligned with the loss positions); `mask` [N] bool.
    Returns 'routing_token_share', 'routing_layer_share', 'routing_tokens' and, with `group_ids` [N]
    (-1 = none), the same three under 'group/<id>/'; shares are NaN where no token counts.
    """
    if trainer.shape != sampler.shape:
        raise ValueError(f"routed experts: trainer {tuple(trainer.shape)} vs sampler {tuple(sampler.shape)}")
    valid = mask.to(torch.bool) & (sampler >= 0).all(dim=-1).all(dim=-1)
    diff = layer_differs(trainer, sampler).to(torch.float64)            # [N, L]
    tok = diff.amax(dim=-1)
    lay = diff.mean(dim=-1)
    out: dict[str, float] = {}

    def put(prefix: str, sel: torch.Tensor) -> None:
        n = int(sel.sum())
        out[prefix + "routing_tokens"] = float(n)
        out[prefix + "routing_token_share"] = float(tok[sel].mean()) if n else float("nan")
        out[prefix + "routing_layer_share"] = float(lay[sel].mean()) if n else float("nan")

    put("", valid)
    if group_ids is not None:
        for gid in sorted(set(group_ids[valid].tolist())):
            if gid >= 0:
                put(f"group/{gid}/", valid & (group_ids == gid))
    return out
