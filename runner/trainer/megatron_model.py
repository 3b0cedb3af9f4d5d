"""Build the policy as a Megatron-core `GPTModel` from a mixfleet `ModelSpec`.

Why this file: the trainer, its tests and the runner all need the same model, built the same way on
a CPU-only machine (this project's CI) and on GPUs (production). It owns three things:

- `ensure_parallel_state(device)`: idempotent, process-wide initialization of torch.distributed
  (gloo on CPU, NCCL on CUDA; world size 1 with a private file store, so nothing listens beyond
  127.0.0.1, when nothing initialized it) and of Megatron's global parallel state (TP = PP = 1). Safe
  to call any number of times.
- `build_gpt_model(spec, options)`: the `GPTModel` of the spec: RMSNorm, SwiGLU (`gated_linear_unit`
  + silu), GQA (`num_query_groups`), no biases, zero dropouts, learned absolute positions or RoPE
  (`rotary_base` = the spec's `rope_theta`, rotate-half as HF's Qwen3), per-head QK RMSNorm when
  `qk_norm` (Megatron's `qk_layernorm`, applied before RoPE as in Qwen3), untied head unless the spec
  ties it, the vocabulary padded up to a multiple of `make_vocab_size_divisible_by` (Megatron's
  convention; the padding is stripped by the trainer's logits and by the Hugging Face export).
  MoE (kind = 'moe'): Megatron's `MoELayer` in every layer, `TopKRouter` with softmax scores, top-k, the
  top-k probabilities renormalized when `norm_topk_prob` (Megatron: top-k of the logits, then softmax
  over the k, which is the same number; `moe_router_pre_softmax` when not renormalized), router in
  fp32, no auxiliary loss (the RL loss is the policy loss alone), no shared experts in the export
  layouts, no token dropping. Router replay (`PartialRouterReplay`) is attached to every router: it
  records the trainer's own experts per token and can replay the sampler's (`routing.py`).
  CPU path: `use_cpu_initialization`, the local layer spec with `SDPACoreAttention` as core attention,
  experts as Megatron's `SequentialMLP`, the all-gather token dispatcher (world size 1: a no-op
  gather; the all-to-all dispatcher creates a `torch.cuda.Stream` in its constructor), and the two
  CPU-safe subclasses of `cpu_safe.py` (rotary embedding, router gating).
  GPU path: Transformer Engine's layer spec when `transformer_engine` imports (MoE: TE grouped GEMM
  experts, all-to-all dispatcher), else the local spec with the same SDPA module; bf16 autocast over
  fp32 master weights. The GPU path is written to the same contract but has not been run on this
  project's machines (no GPU here).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import socket
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from mixfleet.costmodel.specs.model import ModelSpec

DEVICES = ("auto", "cpu", "cuda")
TE_CHOICES = ("auto", "yes", "no")


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


def loopback_interface() -> str | None:
    """The name of the network interface holding 127.0.0.1 ("lo" on Linux, "lo0" on macOS), None if unknown."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == "127.0.0.1" for a in addrs):
            return name
    return None


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
        # a file store, not tcp://: c10d's TCPStore server listens on every interface ("::") whatever host the
        # URL names, and the trainer is one process; the store file is empty, private and removed at exit
        if backend == "gloo" and not os.environ.get("GLOO_SOCKET_IFNAME"):
            # gloo binds the address the host name resolves to (often the LAN address): the loopback device instead
            lo = loopback_interface()
            if lo is not None:
                os.environ["GLOO_SOCKET_IFNAME"] = lo
        fd, store = tempfile.mkstemp(prefix="mixfleet-dist-")
        os.close(fd)
        atexit.register(lambda: os.path.exists(store) and os.unlink(store))
        try:
            dist.init_process_group(backend, init_method=f"file://{store}", world_size=1, rank=0)
        except (RuntimeError, OSError) as e:
            raise RuntimeError(f"could not initialize torch.distributed ({backend}) with the file store {store}: "
                               f"{e}") from None
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


CPU_MAX_PARAMS = 2_000_000_000   # a CPU build above this would allocate > 8 GiB of fp32 weights (+ AdamW x3)


def _check_spec(spec: ModelSpec, device: str, use_te: bool) -> None:
    where = f"model '{spec.name}'"
    if spec.norm != "rmsnorm":
        raise ValueError(f"{where}: norm = {spec.norm!r}; allowed: rmsnorm")
    if spec.activation != "swiglu":
        raise ValueError(f"{where}: activation = {spec.activation!r}; allowed: swiglu")
    if spec.qk_norm and spec.position_embedding != "rope":
        raise ValueError(f"{where}: qk_norm = true with position_embedding = {spec.position_embedding!r}; "
                         "allowed: qk_norm with rope (the Qwen3 layouts)")
    if device == "cpu" and spec.total_params > CPU_MAX_PARAMS:
        raise ValueError(f"{where}: {spec.total_params / 1e9:.1f}B parameters on CPU; allowed on CPU: <= "
                         f"{CPU_MAX_PARAMS / 1e9:.0f}B (fp32 weights + AdamW state); use device = 'cuda'")


def transformer_config(spec: ModelSpec, device: str, options: BuildOptions) -> Any:
    """The Megatron TransformerConfig of a spec (no dropout, no biases, fusions off on CPU)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    on_cpu = device == "cpu"
    kw: dict[str, Any] = dict(
        num_layers=spec.num_layers, hidden_size=spec.hidden_size, num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_kv_heads, kv_channels=spec.head_dim,
        ffn_hidden_size=spec.ffn_hidden_size if spec.ffn_hidden_size > 0 else None,
        normalization="RMSNorm", layernorm_epsilon=spec.norm_eps, qk_layernorm=spec.qk_norm,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
        add_qkv_bias=False, hidden_dropout=0.0, attention_dropout=0.0, init_method_std=options.init_method_std,
        use_cpu_initialization=on_cpu, params_dtype=torch.float32,
        bias_activation_fusion=not on_cpu, bias_dropout_fusion=not on_cpu, masked_softmax_fusion=not on_cpu,
        persist_layer_norm=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
    )
    if spec.moe is not None:
        kw.update(num_moe_experts=spec.moe.num_experts, moe_router_topk=spec.moe.active_experts,
                  moe_ffn_hidden_size=spec.moe.expert_ffn_hidden_size, moe_grouped_gemm=not on_cpu,
                  moe_router_score_function="softmax", moe_router_pre_softmax=not spec.moe.norm_topk_prob,
                  moe_router_dtype="fp32", moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
                  moe_token_dispatcher_type="allgather" if on_cpu else "alltoall")
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
        return get_gpt_layer_with_transformer_engine_spec(num_experts=num_experts, qk_layernorm=spec.qk_norm,
                                                          moe_grouped_gemm=num_experts is not None)
    from mixfleet.runner.trainer.cpu_safe import CPUTopKRouter
    from mixfleet.runner.trainer.sdpa_attention import SDPACoreAttention

    ls = get_gpt_layer_local_spec(num_experts=num_experts, normalization="RMSNorm", qk_layernorm=spec.qk_norm)
    ls.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    if num_experts is not None:
        # Megatron's Router.gating calls torch.cuda.current_device() and a TE-only GEMM: see cpu_safe.py.
        ls.submodules.mlp.submodules.router = CPUTopKRouter
    return ls


def moe_routers(model: torch.nn.Module) -> list[Any]:
    """The MoE routers of a built GPTModel, in layer order (empty for a dense model)."""
    from megatron.core.transformer.moe.router import Router

    return [m for m in model.modules() if isinstance(m, Router)]


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
        position_embedding_type=spec.position_embedding, rotary_base=spec.rope_theta,
    )
    if spec.position_embedding == "rope" and device == "cpu":
        # RotaryEmbedding.get_emb moves inv_freq to torch.cuda.current_device() (see cpu_safe.py); GPTModel
        # builds it directly (no spec hook), so the same module without that move replaces it here.
        from mixfleet.runner.trainer.cpu_safe import CPURotaryEmbedding

        old = model.rotary_pos_emb
        model.rotary_pos_emb = CPURotaryEmbedding(
            kv_channels=spec.head_dim, rotary_percent=1.0, rotary_interleaved=old.rotary_interleaved,
            seq_len_interpolation_factor=old.seq_len_interpolation_factor, rotary_base=spec.rope_theta,
            use_cpu_initialization=True, cp_group=old.cp_group)
    from mixfleet.runner.trainer.cpu_safe import PartialRouterReplay

    for router in moe_routers(model):
        # Megatron's topk_routing_with_score_function consults router.router_replay (its replay hook).
        router.router_replay = PartialRouterReplay()
    if device == "cuda":
        model = model.cuda()
    return BuiltModel(model=model, spec=spec, device=device, padded_vocab_size=vocab,
                      uses_transformer_engine=use_te,
                      autocast_dtype=torch.bfloat16 if device == "cuda" else None)


def output_layer_weight(model: torch.nn.Module) -> torch.Tensor:
    """The weight [padded_vocab, H] the GPTModel's output layer multiplies its input by (tied: the embedding's).

    As Megatron's `GPTModel._postprocess` picks it: `shared_embedding_or_output_weight()` when the
    embeddings are shared, else `output_layer.weight`.
    """
    if getattr(model, "share_embeddings_and_output_weights", False):
        return model.shared_embedding_or_output_weight()
    return model.output_layer.weight


@contextlib.contextmanager
def without_output_layer(model: torch.nn.Module) -> Iterator[None]:
    """Within: `model(...)` returns the decoder's final hidden states [S, B, H] (after the final norm),
    not logits. Megatron's own hook for a stage without the output layer: GPTModel._postprocess returns
    its input when `post_process` is False (the decoder's final norm was built with the model and
    stays). A GPTModel built for the last stage, without multi-token prediction, is required."""
    if not getattr(model, "post_process", False) or getattr(model, "mtp_process", False):
        raise ValueError("without_output_layer needs a GPTModel built with post_process=True and no MTP block")
    model.post_process = False
    try:
        yield
    finally:
        model.post_process = True
