"""Build the policy as a Megatron-core `GPTModel` from a mixfleet `ModelSpec`.

Why this file: the trainer, its tests and the runner all need the same model, built the same way on
a CPU-only machine (this project's CI) and on GPUs (production). It owns three things:

- `ensure_parallel_state(device)`: idempotent, process-wide initialization of torch.distributed
  (gloo on CPU, NCCL on CUDA; world size 1 on 127.0.0.1 with a free port when nothing initialized
  it) and of Megatron's global parallel state (TP = PP = 1). Safe to call any number of times.
- `build_gpt_model(spec, options)`: the `GPTModel` of the spec: RMSNorm, SwiGLU (`gated_linear_unit`
  + silu), GQA (`num_query_groups`), no biases, zero dropouts, learned absolute positions (RoPE on
  CUDA only: Megatron's rotary code calls `torch.cuda`), untied head unless the spec ties it, the
  vocabulary padded up to a multiple of `make_vocab_size_divisible_by` (Megatron's convention; the
  padding is stripped by the trainer's logits and by the Hugging Face export).
  CPU path: `use_cpu_initialization`, the local layer spec with `SDPACoreAttention` as core attention.
  GPU path: Transformer Engine's layer spec when `transformer_engine` imports, else the local spec
  with the same SDPA module; bf16 autocast over fp32 master weights. The GPU path is written to the
  same contract but has not been run on this project's machines (no GPU here).
- MoE specs build only on CUDA with Transformer Engine (Megatron's MoE router calls CUDA); the
  Hugging Face export (dense layout) refuses them.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from mixfleet.costmodel.model import ModelSpec

DEVICES = ("auto", "cpu", "cuda")
TE_CHOICES = ("auto", "yes", "no")
_PORT_TRIES = 3


def _import_megatron() -> Any:
    """Import megatron.core quietly (it warns at import about missing Apex / Transformer Engine)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import megatron.core.models.gpt  # noqa: F401
        import megatron.core.optimizer  # noqa: F401  (imported by gpt; silenced here once)
        from megatron.core import parallel_state
    return parallel_state


def resolve_device(device: str) -> str:
    """'auto' -> 'cuda' when torch sees a GPU, else 'cpu'; refuses 'cuda' without one."""
    if device not in DEVICES:
        raise ValueError(f"device = {device!r}; allowed: {', '.join(DEVICES)}")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device = 'cuda' but torch sees no CUDA device; allowed here: cpu, auto")
    return device


def have_transformer_engine() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not usable"
        return False
    return True


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_free_port = free_port   # older name, used by runner/orchestration/actors.py


def ensure_parallel_state(device: str = "cpu") -> None:
    """Initialize torch.distributed (world size 1) and Megatron's parallel state once per process.

    Idempotent: a second call (from another trainer, or a test) does nothing. A process group set up
    by someone else is reused; it must have world size 1 (this trainer does not do data parallelism).
    """
    parallel_state = _import_megatron()
    if not dist.is_initialized():
        backend = "nccl" if device == "cuda" else "gloo"
        if device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        last: Exception | None = None
        for _ in range(_PORT_TRIES):
            try:
                dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}",
                                        world_size=1, rank=0)
                break
            except (RuntimeError, OSError) as e:   # the free port was taken in between: retry
                last = e
        else:
            raise RuntimeError(f"could not initialize torch.distributed ({backend}) on 127.0.0.1: {last}")
    if dist.get_world_size() != 1:
        raise ValueError(f"torch.distributed world size = {dist.get_world_size()}; allowed: 1 "
                         "(the trainer runs in one process, TP = PP = 1)")
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)


def padded_vocab_size(vocab_size: int, divisible_by: int, tp_size: int = 1) -> int:
    """Megatron's padding: round the vocabulary up to a multiple of divisible_by * tp_size."""
    if divisible_by <= 0 or tp_size <= 0:
        raise ValueError(f"make_vocab_size_divisible_by = {divisible_by}, tp = {tp_size}; allowed: positive integers")
    multiple = divisible_by * tp_size
    return -(-vocab_size // multiple) * multiple


@dataclass(frozen=True, kw_only=True)
class BuildOptions:
    """How to build the model (not what: that is the ModelSpec)."""

    device: str = "auto"                      # auto | cpu | cuda
    seed: int = 0                             # initialization seed
    make_vocab_size_divisible_by: int = 128   # Megatron's vocabulary padding multiple
    transformer_engine: str = "auto"          # auto | yes | no (CUDA only; CPU always uses the local spec)
    init_method_std: float = 0.02

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ValueError(f"BuildOptions.device = {self.device!r}; allowed: {', '.join(DEVICES)}")
        if self.transformer_engine not in TE_CHOICES:
            raise ValueError(f"BuildOptions.transformer_engine = {self.transformer_engine!r}; "
                             f"allowed: {', '.join(TE_CHOICES)}")
        if not isinstance(self.make_vocab_size_divisible_by, int) or self.make_vocab_size_divisible_by <= 0:
            raise ValueError(f"BuildOptions.make_vocab_size_divisible_by = {self.make_vocab_size_divisible_by!r}; "
                             "allowed: a positive integer")
        if not self.init_method_std > 0:
            raise ValueError(f"BuildOptions.init_method_std = {self.init_method_std!r}; allowed: > 0")


@dataclass(frozen=True, kw_only=True)
class BuiltModel:
    """A built GPTModel and the facts the trainer and the export need about it."""

    model: torch.nn.Module
    spec: ModelSpec
    device: str
    padded_vocab_size: int
    uses_transformer_engine: bool
    autocast_dtype: torch.dtype | None        # bf16 on CUDA, None (pure fp32) on CPU


def _check_spec(spec: ModelSpec, device: str, use_te: bool) -> None:
    where = f"model '{spec.name}'"
    if spec.kind == "moe" and not (device == "cuda" and use_te):
        raise ValueError(f"{where}: kind = 'moe' needs CUDA and Transformer Engine (Megatron's MoE router "
                         f"calls torch.cuda); allowed here (device {device}): kind = 'dense'")
    if spec.norm != "rmsnorm":
        raise ValueError(f"{where}: norm = {spec.norm!r}; allowed: rmsnorm")
    if spec.activation != "swiglu":
        raise ValueError(f"{where}: activation = {spec.activation!r}; allowed: swiglu")
    if device == "cpu" and spec.position_embedding != "learned_absolute":
        raise ValueError(f"{where}: position_embedding = {spec.position_embedding!r} on CPU; allowed on CPU: "
                         "learned_absolute (Megatron-core's rotary embedding calls torch.cuda)")


def transformer_config(spec: ModelSpec, device: str, options: BuildOptions) -> Any:
    """The Megatron TransformerConfig of a spec (no dropout, no biases, fusions off on CPU)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    on_cpu = device == "cpu"
    kw: dict[str, Any] = dict(
        num_layers=spec.num_layers, hidden_size=spec.hidden_size, num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_kv_heads, kv_channels=spec.head_dim,
        ffn_hidden_size=spec.ffn_hidden_size if spec.ffn_hidden_size > 0 else None,
        normalization="RMSNorm", layernorm_epsilon=spec.norm_eps,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
        add_qkv_bias=False, hidden_dropout=0.0, attention_dropout=0.0, init_method_std=options.init_method_std,
        use_cpu_initialization=on_cpu, params_dtype=torch.float32,
        bias_activation_fusion=not on_cpu, bias_dropout_fusion=not on_cpu, masked_softmax_fusion=not on_cpu,
        persist_layer_norm=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
    )
    if spec.moe is not None:
        kw.update(num_moe_experts=spec.moe.num_experts, moe_router_topk=spec.moe.active_experts,
                  moe_ffn_hidden_size=spec.moe.expert_ffn_hidden_size, moe_grouped_gemm=True,
                  moe_token_dispatcher_type="alltoall")
        if spec.moe.shared_experts:
            kw["moe_shared_expert_intermediate_size"] = spec.moe.shared_experts * spec.moe.expert_ffn_hidden_size
        if spec.ffn_hidden_size <= 0:
            kw["ffn_hidden_size"] = spec.moe.expert_ffn_hidden_size
    return TransformerConfig(**kw)


def layer_spec(spec: ModelSpec, use_te: bool) -> Any:
    """Transformer Engine spec (CUDA) or the local spec with SDPA core attention (CPU, or CUDA without TE)."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    num_experts = spec.moe.num_experts if spec.moe is not None else None
    if use_te:
        return get_gpt_layer_with_transformer_engine_spec(num_experts=num_experts,
                                                          moe_grouped_gemm=num_experts is not None)
    from mixfleet.runner.trainer.sdpa_attention import SDPACoreAttention

    ls = get_gpt_layer_local_spec(num_experts=num_experts, normalization="RMSNorm")
    ls.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    return ls


def build_gpt_model(spec: ModelSpec, options: BuildOptions | None = None) -> BuiltModel:
    """Initialize the parallel state if needed and build the spec's GPTModel (fp32 weights), seeded."""
    options = options or BuildOptions()
    device = resolve_device(options.device)
    want_te = options.transformer_engine
    if want_te == "yes" and not (device == "cuda" and have_transformer_engine()):
        raise ValueError("transformer_engine = 'yes' needs CUDA and an importable transformer_engine; "
                         "allowed here: auto, no")
    use_te = device == "cuda" and want_te != "no" and have_transformer_engine()
    _check_spec(spec, device, use_te)
    ensure_parallel_state(device)
    from megatron.core.models.gpt import GPTModel

    torch.manual_seed(options.seed)
    if device == "cuda":
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(options.seed)
    vocab = padded_vocab_size(spec.vocab_size, options.make_vocab_size_divisible_by)
    model = GPTModel(
        config=transformer_config(spec, device, options), transformer_layer_spec=layer_spec(spec, use_te),
        vocab_size=vocab, max_sequence_length=spec.max_context, pre_process=True, post_process=True,
        parallel_output=False, share_embeddings_and_output_weights=spec.tie_embeddings,
        position_embedding_type=spec.position_embedding, rotary_base=10000,
    )
    if device == "cuda":
        model = model.cuda()
    return BuiltModel(model=model, spec=spec, device=device, padded_vocab_size=vocab,
                      uses_transformer_engine=use_te,
                      autocast_dtype=torch.bfloat16 if device == "cuda" else None)
