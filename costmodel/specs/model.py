"""Model specs: the architecture numbers the cost model, the engine and the trainer share.

A spec is a TOML file (data/models/*.toml, or any path). Dense and MoE decoders: layers, hidden,
heads, KV heads, head dim, FFN width, vocabulary, context; MoE adds experts / active experts /
expert width. Parameter counts here feed the roofline (bytes read per decode step, FLOPs).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mixfleet.costmodel.errors import SpecError
from mixfleet.costmodel.paths import resolve_shipped, shipped_names
from mixfleet.costmodel.tomlread import read_toml

POSITION_EMBEDDINGS = ("learned_absolute", "rope")
KINDS = ("dense", "moe")


@dataclass(frozen=True, kw_only=True)
class MoESpec:
    num_experts: int                 # routed experts per MoE layer
    active_experts: int              # top-k experts per token
    expert_ffn_hidden_size: int      # SwiGLU inner width of one expert
    shared_experts: int = 0          # always-active experts of the same width
    norm_topk_prob: bool = True      # renormalize the top-k router probabilities to sum to 1 (HF `norm_topk_prob`)


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    name: str
    kind: str                        # "dense" | "moe"
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int             # dense SwiGLU inner width (0 if every layer is MoE)
    vocab_size: int
    max_context: int                 # tokens
    position_embedding: str = "learned_absolute"
    norm: str = "rmsnorm"
    norm_eps: float = 1e-5
    activation: str = "swiglu"
    tie_embeddings: bool = False
    rope_theta: float = 10000.0      # RoPE base (position_embedding = "rope")
    qk_norm: bool = False            # per-head RMSNorm of queries and keys before RoPE (Qwen3)
    estimate: bool = False           # True when the numbers are an estimate, not a published config
    source: str = ""
    hf_id: str = ""                  # the published config this spec reproduces (e.g. "Qwen/Qwen3-30B-A3B"), if any
    moe: MoESpec | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        where = f"model '{self.name}'"
        if self.kind not in KINDS:
            raise SpecError(where, "kind", self.kind, KINDS)
        if self.position_embedding not in POSITION_EMBEDDINGS:
            raise SpecError(where, "position_embedding", self.position_embedding, POSITION_EMBEDDINGS)
        for name in ("num_layers", "hidden_size", "num_attention_heads", "num_kv_heads", "head_dim",
                     "vocab_size", "max_context"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise SpecError(where, name, v, "a positive integer")
        if self.num_attention_heads % self.num_kv_heads:
            raise SpecError(where, "num_kv_heads", self.num_kv_heads,
                            f"a divisor of num_attention_heads ({self.num_attention_heads})")
        if self.kind == "moe" and self.moe is None:
            raise SpecError(where, "moe", None, "a [moe] table for kind = 'moe'")
        if self.kind == "dense" and self.ffn_hidden_size <= 0:
            raise SpecError(where, "ffn_hidden_size", self.ffn_hidden_size, "a positive integer for a dense model")
        if not isinstance(self.rope_theta, int | float) or isinstance(self.rope_theta, bool) or not self.rope_theta > 0:
            raise SpecError(where, "rope_theta", self.rope_theta, "a number > 0")
        if not isinstance(self.qk_norm, bool):
            raise SpecError(where, "qk_norm", self.qk_norm, "true or false")
        if self.moe is not None:
            for name in ("num_experts", "expert_ffn_hidden_size"):
                v = getattr(self.moe, name)
                if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                    raise SpecError(where, f"moe.{name}", v, "a positive integer")
            if not isinstance(self.moe.shared_experts, int) or self.moe.shared_experts < 0:
                raise SpecError(where, "moe.shared_experts", self.moe.shared_experts, "an integer >= 0")
            if not isinstance(self.moe.norm_topk_prob, bool):
                raise SpecError(where, "moe.norm_topk_prob", self.moe.norm_topk_prob, "true or false")
        if self.moe is not None and not 0 < self.moe.active_experts <= self.moe.num_experts:
            raise SpecError(where, "moe.active_experts", self.moe.active_experts,
                            f"1..num_experts ({self.moe.num_experts})")

    # ---- parameter counts (weights only, no scales) -------------------------------------------
    @property
    def attention_params_per_layer(self) -> int:
        h, d = self.hidden_size, self.head_dim
        return h * d * (self.num_attention_heads * 2 + self.num_kv_heads * 2)  # q, o, k, v

    @property
    def dense_ffn_params_per_layer(self) -> int:
        return 3 * self.hidden_size * self.ffn_hidden_size

    @property
    def expert_params(self) -> int:
        """Parameters of one routed expert (SwiGLU: gate, up, down)."""
        return 0 if self.moe is None else 3 * self.hidden_size * self.moe.expert_ffn_hidden_size

    @property
    def embedding_params(self) -> int:
        emb = self.vocab_size * self.hidden_size
        pos = self.max_context * self.hidden_size if self.position_embedding == "learned_absolute" else 0
        return emb + pos + (0 if self.tie_embeddings else emb)

    @property
    def total_params(self) -> int:
        per_layer = self.attention_params_per_layer + self.dense_ffn_params_per_layer
        if self.moe is not None:
            per_layer += self.expert_params * (self.moe.num_experts + self.moe.shared_experts)
            per_layer += self.hidden_size * self.moe.num_experts  # router
        return self.num_layers * per_layer + self.embedding_params

    @property
    def active_params(self) -> int:
        """Parameters touched per token (FLOPs = 2 * active_params per token, forward)."""
        per_layer = self.attention_params_per_layer + self.dense_ffn_params_per_layer
        if self.moe is not None:
            per_layer += self.expert_params * (self.moe.active_experts + self.moe.shared_experts)
            per_layer += self.hidden_size * self.moe.num_experts
        out_emb = self.vocab_size * self.hidden_size  # the LM head matmul; input embedding is a gather
        return self.num_layers * per_layer + out_emb

    @property
    def kv_elements_per_token(self) -> int:
        """K and V elements stored per token, all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if d["moe"] is None:
            d.pop("moe")
        if not d["extra"]:
            d.pop("extra")
        return d


def model_spec_from_dict(raw: dict[str, Any], where: str = "model spec") -> ModelSpec:
    """Build a ModelSpec from a TOML table; unknown keys are refused, naming the known ones."""
    raw = dict(raw)
    moe_raw = raw.pop("moe", None)
    known = {f for f in ModelSpec.__dataclass_fields__ if f not in ("moe",)}
    for key in raw:
        if key not in known:
            raise SpecError(where, key, raw[key], "a known field: " + ", ".join(sorted(known)))
    required = ("name", "kind", "num_layers", "hidden_size", "num_attention_heads", "num_kv_heads",
                "head_dim", "ffn_hidden_size", "vocab_size", "max_context")
    for key in required:
        if key not in raw:
            raise SpecError(where, key, None, "a value (the field is required)")
    moe = None
    if moe_raw is not None:
        moe_known = set(MoESpec.__dataclass_fields__)
        for key in moe_raw:
            if key not in moe_known:
                raise SpecError(where, f"moe.{key}", moe_raw[key], "one of " + ", ".join(sorted(moe_known)))
        try:
            moe = MoESpec(**moe_raw)
        except TypeError as e:
            allowed = f"num_experts, active_experts, expert_ffn_hidden_size ({e})"
            raise SpecError(where, "moe", moe_raw, allowed) from None
    return ModelSpec(**raw, moe=moe)


def known_models() -> list[str]:
    """Names of the model specs shipped in data/models."""
    return shipped_names("models")


def load_model_spec(name_or_path: str | Path) -> ModelSpec:
    """Load a model spec by shipped name (e.g. 'tiny') or by TOML path."""
    path = resolve_shipped("models", name_or_path, "model")
    if not path.exists():
        raise FileNotFoundError(f"model spec file not found: {path}")
    return model_spec_from_dict(read_toml(path), where=str(path))
