"""Ray actors of a real run: one per sampler replica, one for the trainer.

Why actors: a run spreads over processes (here) or nodes (a cluster) without the orchestrator caring.
`SamplerWorker` runs one sampler replica in its own process: an embedded engine behind the SGLang-
protocol server (runner/engine + runner/server) on 127.0.0.1 and a free port, or a real SGLang server
(runner/sglang_launch) on a GPU node; the orchestrator talks to it over HTTP only (runner/client), so
an attached URL and an actor look the same to it. `TrainerWorker` owns the Megatron-core Trainer
(runner/trainer) and the corrected policy loss (runner/corrections): train one update, export the
weights in the Hugging Face layout the samplers load, save / resume its state.

Placement: each replica asks Ray for its group's accelerator as a custom resource (`{"H100": tp}`),
spread over the nodes that carry it (a node lost takes as few replicas as it can); a local Ray (the
default) declares the plan's accelerators as logical resources so the same request is satisfied on one
machine (the `--embedded` rehearsal). Actors take num_cpus=0 and one torch thread each by default, so a
2-core machine can hold several of them.

Addresses: a replica on the driver's node (every replica of a local run) serves on 127.0.0.1; a replica on
another node serves on that node's Ray address (the only address the driver can reach it on), and only
then (`serve_host`). Every replica requires the run's API key (`api_key`, SGLang's `--api-key`).

Weights: a replica given `weights` (a published version, runner/orchestration/distribution.py) starts
from its node's local copy, fetched once for the node by the node's cache; it never reads the trainer's
folder. `TrainerWorker.export_and_publish` exports a version, puts it into Ray's object store and deletes
the export.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mixfleet.runner.sampler.replica import ReplicaLaunch

LOOPBACK = "127.0.0.1"
RAY_START_ATTEMPTS = 4      # a local Ray whose raylet does not register within Ray's 30 s (busy machine) is retried
RAY_RETRY_GAP_S = 10.0      # x attempt: the wait before the next try (Ray start-ups overload a small host)


def _free_port(host: str) -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _this_node() -> tuple[str | None, str]:
    """(Ray node id, node address) of this process; (None, 127.0.0.1) outside Ray (in-process tests)."""
    import ray

    if not ray.is_initialized():
        return None, LOOPBACK
    return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()


def serve_host(node_id: str | None, driver_node: str | None, node_ip: str) -> str:
    """The address a sampler binds: 127.0.0.1 on the driver's node (or when the driver's node is not
    known), the node's own address on any other node (where the driver must reach it)."""
    if node_id is None or driver_node is None or node_id == driver_node:
        return LOOPBACK
    return node_ip


def _set_threads(threads: int) -> None:
    import torch

    torch.set_num_threads(max(1, int(threads)))
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass                                   # already set in this process


class SamplerWorker:
    """One sampler replica (run as a Ray actor, or in-process in tests), started from its one launch record
    (runner/sampler/replica.py `ReplicaLaunch`)."""

    def __init__(self, launch: ReplicaLaunch) -> None:
        self.launch = launch
        self.group, self.index, self.mode = launch.group, launch.index, launch.mode
        self._handle: Any = None
        self._proc: Any = None
        self.started_s = time.time()
        self.node_id, node_ip = _this_node()
        self.host = serve_host(self.node_id, launch.driver_node, node_ip)
        self.transfer_s = 0.0
        model_path = launch.model_path
        if launch.weights is not None:           # the pinned version, from this node's own cache
            from mixfleet.runner.orchestration.distribution import local_path

            model_path, self.transfer_s = local_path(launch.weights, launch.run)
        self.model_path = model_path
        if launch.mode == "embedded":
            _set_threads(launch.threads)
            from mixfleet.runner.sampler.engine import Engine
            from mixfleet.runner.sampler.replica import embedded_settings
            from mixfleet.runner.sampler.server_launch import start_in_thread

            engine_kw, server_args = embedded_settings(launch, model_path=str(model_path), host=self.host)
            self._handle = start_in_thread(Engine(**engine_kw), server_args=server_args)
            self.url = self._handle.url
        else:
            from mixfleet.runner.sampler.sglang_launch import launch as launch_server
            from mixfleet.runner.sampler.sglang_launch import spec_for_replica

            spec = spec_for_replica(launch, model_path=str(model_path), port=_free_port(self.host), host=self.host)
            self._proc, attached = launch_server(spec)
            self.url = attached.url
        self.ready_s = time.time() - self.started_s

    def cpu_s(self) -> float:
        """CPU seconds (user + system) this process has used."""
        t = os.times()
        return t.user + t.system

    def info(self) -> dict[str, Any]:
        return {"group": self.group, "index": self.index, "url": self.url, "pid": os.getpid(),
                "ready_s": self.ready_s, "mode": self.mode, "node_id": self.node_id, "host": self.host,
                "model_path": str(self.model_path), "transfer_s": self.transfer_s}

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.stop()
            self._handle = None
        if self._proc is not None:
            self._proc.terminate()
            self._proc = None


class TrainerWorker:
    """The trainer (run as a Ray actor, or in-process): one optimizer step per update with the corrected loss."""

    def __init__(self, *, init_from: str, state_dir: str | None, correction: Mapping[str, Any],
                 optimizer: Mapping[str, Any] | None = None, threads: int = 1, resume: bool = False,
                 export_dtype: str = "float32", routing: str = "free") -> None:
        _set_threads(threads)
        from mixfleet.runner.corrections import CorrectionConfig
        from mixfleet.runner.trainer import Trainer
        from mixfleet.runner.trainer.trainer import OptimizerConfig, TrainerConfig

        self.correction = CorrectionConfig.from_mapping(dict(correction))
        self.state_dir = Path(state_dir) if state_dir else None
        t0 = time.perf_counter()
        if resume and self.state_dir is not None and (self.state_dir / "trainer_meta.json").exists():
            self.trainer = Trainer.resume(self.state_dir, optimizer=optimizer)   # the run's settings, not the saved
        else:
            opt = dict(optimizer or {})
            if "betas" in opt:
                opt["betas"] = tuple(opt["betas"])
            cfg = TrainerConfig(optimizer=OptimizerConfig(**opt), export_dtype=export_dtype, routing=routing)
            self.trainer = Trainer.from_checkpoint(init_from, cfg)
            self.trainer.version = 0
        self.build_s = time.perf_counter() - t0

    def version(self) -> int:
        return int(self.trainer.version)

    def pid(self) -> int:
        """This actor's process (tests kill it: costmodel/records/writepoints.py)."""
        return os.getpid()

    def cpu_s(self) -> float:
        """CPU seconds (user + system) this process has used."""
        t = os.times()
        return t.user + t.system

    def train(self, tensors: Mapping[str, Any]) -> dict[str, Any]:
        """One update on a `runner.batching.TrainBatch.tensors` mapping; returns the step's metrics."""
        from mixfleet.runner.orchestration.batching import correction_batch
        from mixfleet.runner.trainer.trainer import policy_loss_fn

        # the output layer fused into the corrections' loss: the step never builds [T, V] logits
        loss_fn = policy_loss_fn(self.correction, correction=correction_batch)
        return dict(self.trainer.train_step(dict(tensors), loss_fn))

    def export(self, directory: str, version: int | None = None) -> str:
        """Write the current weights (HF layout) to `directory`; returns its path."""
        return str(self.trainer.export_hf(directory, version))

    def export_and_publish(self, directory: str, version: int) -> dict[str, Any]:
        """Export version `version` to `directory`, publish it into Ray's object store (once), delete the
        export: samplers fetch it per node (runner/orchestration/distribution.py). Returns the published
        version with its "export_s" and "publish_s"."""
        import shutil

        from mixfleet.runner.orchestration.distribution import publish_folder

        t0 = time.perf_counter()
        path = self.export(directory, version)
        export_s = time.perf_counter() - t0
        published = publish_folder(path, version=version)
        shutil.rmtree(path, ignore_errors=True)
        return {**published, "export_s": export_s}

    def save_state(self, directory: str | None = None) -> str:
        target = Path(directory) if directory else self.state_dir
        if target is None:
            raise ValueError("TrainerWorker.save_state: no directory (give one or a state_dir)")
        return str(self.trainer.save_state(target))

    def token_logprobs(self, input_ids: Any, temperature: float = 1.0) -> Any:
        return self.trainer.token_logprobs(input_ids, temperature=temperature)


def _startup_failure(e: BaseException) -> bool:
    """A local Ray that did not come up (worth another try): Ray raises a bare Exception when its node times out
    during start-up, or a connection / time-out error reaching its own GCS."""
    return type(e) is Exception or isinstance(e, ConnectionError | TimeoutError) or "timed out" in str(e)


def init_ray(*, address: str | None = None, num_cpus: int | None = None,
             resources: Mapping[str, float] | None = None) -> None:
    """Connect to a Ray cluster (`address`) or start a local one declaring `resources` (idempotent).

    A local Ray listens on 127.0.0.1 only and is recorded, so that a later start or `mixfleet cleanup`
    stops it if this driver dies without shutting it down (runner/orchestration/local_ray.py); leftovers of
    earlier killed drivers are stopped first. A local start that fails the way a busy host makes it fail is
    tried again (`RAY_START_ATTEMPTS`, `RAY_RETRY_GAP_S` x attempt apart): the one Ray retry loop. `ray.init`
    installs its own SIGTERM handler (exit at once); a handler the caller had set (the launcher's stop after
    the current update) is put back."""
    import signal
    import threading

    import ray

    if ray.is_initialized():
        return
    main = threading.current_thread() is threading.main_thread()
    ours = signal.getsignal(signal.SIGTERM) if main else None
    env = {"env_vars": {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
                        "PYTHONWARNINGS": "ignore"}}
    try:
        if address:
            ray.init(address=address, runtime_env=env, log_to_driver=False)
            return
        _start_local_ray(num_cpus, resources, env)
    finally:
        if callable(ours) and main:
            signal.signal(signal.SIGTERM, ours)


@contextlib.contextmanager
def _environ(values: Mapping[str, str]) -> Iterator[None]:
    """`values` in os.environ while the block runs (the processes it starts inherit them), then as before."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _start_local_ray(num_cpus: int | None, resources: Mapping[str, float] | None, env: dict[str, Any]) -> None:
    import ray
    from mixfleet.runner.orchestration import local_ray

    local_ray.stop_leftover_rays()
    local_ray.loopback_only()
    token = local_ray.new_token()
    local_ray.record_local_ray(token)
    with local_ray.marking(token):
        for attempt in range(RAY_START_ATTEMPTS):
            try:
                # address="local": always a new Ray of our own; with None, Ray joins whatever cluster RAY_ADDRESS
                # or /tmp/ray/ray_current_cluster (left by anyone's `ray start` on this machine) names
                with _environ(env["env_vars"]):    # inherited by the local Ray's raylet and so every worker
                    ctx = ray.init(address="local",
                                   num_cpus=num_cpus if num_cpus is not None else (os.cpu_count() or 2),
                                   include_dashboard=False, _node_ip_address=local_ray.LOOPBACK,
                                   resources={k: float(v) for k, v in (resources or {}).items()},
                                   log_to_driver=False, configure_logging=True, logging_level="ERROR")
                break
            except Exception as e:  # noqa: BLE001 - Ray's own "node timed out during startup" on a busy machine
                if attempt == RAY_START_ATTEMPTS - 1 or not _startup_failure(e):
                    raise
                print(f"ray start attempt {attempt + 1} of {RAY_START_ATTEMPTS} failed: {e}", flush=True)
                with contextlib.suppress(Exception):
                    ray.shutdown()
                time.sleep(RAY_RETRY_GAP_S * (attempt + 1))
    local_ray.record_local_ray(token, started=True)
    node_ip = ctx.address_info.get("node_ip_address")
    if node_ip != local_ray.LOOPBACK:
        ray.shutdown()
        raise RuntimeError(f"the local Ray took node address {node_ip!r}, not {local_ray.LOOPBACK}: it would listen "
                           "on the network; refusing to run (see runner/orchestration/local_ray.py)")


def remote_sampler(*, accelerator: str, amount: float = 1.0) -> Any:
    """The Ray actor class of a sampler replica placed on `amount` of `accelerator` (a custom resource),
    spread over the nodes carrying it."""
    import ray

    return ray.remote(num_cpus=0, resources={accelerator: float(amount)}, max_restarts=0,
                      scheduling_strategy="SPREAD")(SamplerWorker)


def remote_trainer(*, accelerator: str | None = None, amount: float = 1.0) -> Any:
    import ray

    res = {accelerator: float(amount)} if accelerator else {}
    return ray.remote(num_cpus=0, resources=res, max_restarts=0)(TrainerWorker)
