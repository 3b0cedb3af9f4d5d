"""One sampler replica's launch record, and the embedded engine's settings derived from it.

A run's fleet (runner/orchestration/sampler_fleet.py) builds one frozen `ReplicaLaunch` per replica it
starts, from its group (runner/orchestration/fleet.py `GroupSpec.launch`) and the replica's own values (index,
seed, the weights it starts from, the run's API key); the replica's actor (`actors.SamplerWorker`) takes that
record and nothing else. What a server is started with comes from the record in one function per kind of
server: `embedded_settings` (the embedded engine and its SGLang-protocol server) and
`sglang_launch.spec_for_replica` (a real SGLang server). The KV dtype is `kv_dtype` on the way, as in the
plan; the engine's and SGLang's own spelling (`kv_cache_dtype`, after SGLang's flag) appears only where those
two functions hand it over.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from mixfleet.costmodel.specs.formats import formats

REPLICA_MODES = ("embedded", "sglang")
EMBEDDED_MAX_RUNNING = 256            # the embedded engine's running-request cap (one scheduler, no attention DP)
EMBEDDED_TOKENS_PER_REQUEST = 1024    # its KV budget per running request (max_total_tokens = cap x this)


@dataclass(frozen=True, kw_only=True)
class ReplicaLaunch:
    """Everything one sampler replica is started with (validated on construction)."""

    group: str                                   # the plan group's name
    index: int                                   # the replica's index in its group (events name it)
    mode: str                                    # one of REPLICA_MODES
    precision: str                               # weight format (data/precisions.toml)
    kv_dtype: str                                # KV cache dtype (data/precisions.toml)
    kernel: str | None = None                    # embedded: matmul dtype after dequantization (None: the format's)
    weight_noise: float = 0.0                    # embedded: emulated kernel error, relative std (0 = off)
    tp: int = 1                                  # SGLang --tp-size (GPUs per replica)
    dp_attention: int = 1                        # SGLang --dp-size with --enable-dp-attention
    ep: int = 1                                  # SGLang --ep-size
    threads: int = 1                             # embedded: torch threads of the replica's process
    seed: int = 0                                # embedded: the engine's sampling seed
    model_path: str = ""                         # the checkpoint folder it starts from (when `weights` is None)
    weights: Mapping[str, Any] | None = None     # a published version (distribution.py), fetched by its node
    run: str = ""                                # the run's id (names the node cache `weights` go to)
    weight_version: str | None = None            # the version the server reports at start (None: its own)
    top_p_replay: bool = False                   # record each token's kept top-p set (SGLang: the mask flag)
    routed_experts: bool = False                 # MoE: return each token's routed experts
    api_key: str | None = field(default=None, repr=False)   # required of every request; never shown
    driver_node: str | None = None               # the driver's Ray node (a replica elsewhere binds its node's IP)

    def __post_init__(self) -> None:
        where = f"sampler replica {self.group}#{self.index}"
        if self.mode not in REPLICA_MODES:
            raise ValueError(f"{where}: mode = {self.mode!r}; allowed: {', '.join(REPLICA_MODES)}")
        allowed_p = formats().engine_precisions if self.mode == "embedded" else formats().sglang_precisions
        if self.precision not in allowed_p:
            raise ValueError(f"{where}: precision = {self.precision!r}; allowed: {', '.join(allowed_p)}")
        allowed_kv = formats().engine_kv_dtypes if self.mode == "embedded" else formats().sglang_kv_dtypes
        if self.kv_dtype not in allowed_kv:
            raise ValueError(f"{where}: kv_dtype = {self.kv_dtype!r}; allowed: {', '.join(allowed_kv)}")
        for name in ("tp", "dp_attention", "ep", "threads"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{where}: {name} = {v!r}; allowed: an integer >= 1")
        if self.weights is None and not self.model_path:
            raise ValueError(f"{where}: model_path = ''; allowed: a checkpoint folder (or published weights)")


def embedded_settings(launch: ReplicaLaunch, *, model_path: str, host: str) -> tuple[dict[str, Any], Any]:
    """(the embedded `Engine`'s keyword arguments, its server's `ServerArgs`) for `launch`, the engine loading
    `model_path` (the node-local copy of the launch's weights) and the server binding `host` on a free port."""
    from mixfleet.runner.sampler.server import ServerArgs

    if launch.mode != "embedded":
        raise ValueError(f"sampler replica {launch.group}#{launch.index}: embedded_settings of a {launch.mode!r} "
                         "replica; allowed: mode 'embedded' (SGLang: sglang_launch.spec_for_replica)")
    engine = {"model_path": model_path, "precision": launch.precision, "kv_cache_dtype": launch.kv_dtype,
              "kernel": launch.kernel, "weight_noise": launch.weight_noise, "seed": launch.seed,
              "weight_version": launch.weight_version, "max_running_requests": EMBEDDED_MAX_RUNNING,
              "max_total_tokens": EMBEDDED_MAX_RUNNING * EMBEDDED_TOKENS_PER_REQUEST,
              "enable_return_routed_experts": launch.routed_experts}
    server = ServerArgs(host=host, port=0, kernel=launch.kernel, max_running_requests=EMBEDDED_MAX_RUNNING,
                        api_key=launch.api_key)
    return engine, server
