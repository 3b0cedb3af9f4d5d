"""Real SGLang servers for a plan's sampler groups: the launch command, and attaching by URL.

On GPU clusters a group's replicas are real SGLang servers. `launch_argv` builds the exact
`python -m sglang.launch_server ...` command for one replica from the group's precision, KV dtype
and layout (SGLang quantizes a BF16 checkpoint at load, as the embedded engine does):

    bf16   -> (no --quantization)          fp8   -> --quantization fp8
    nvfp4  -> --quantization modelopt_fp4  mxfp4 -> --quantization mxfp4
    KV fp8_e4m3 -> --kv-cache-dtype fp8_e4m3;   top-p mask replay -> --sampling-mask-max-tokens 512
    layout: --tp-size GPUs [--dp-size D --enable-dp-attention] [--ep-size E]   (the plan's tp, dp_attention, ep)
    api key: the run's key (SGLang then answers 401 unless "Authorization: Bearer KEY"); `launch` hands it over in
             a private YAML file read by SGLang's own `--config FILE.yaml` (`api-key: KEY`, mode 0600, removed once
             the server answers), never on the command line, which every local user sees in `ps`. SGLang has
             no environment variable for it (its ServerArgs.api_key is a flag or a config-file key only).
             `launch_argv(spec)` alone writes `--api-key KEY` (for printing: `describe` masks it).

`attach(url)` connects to an already-running server (SGLang or the embedded one): it checks
/health and /model_info and returns what the server says about itself. Nothing here needs SGLang
installed; `launch` (which does) refuses clearly when it is missing.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from mixfleet.costmodel.specs.formats import formats
from mixfleet.runner.sampler.replica import ReplicaLaunch

# from data/precisions.toml (servers = [..., "sglang"], sglang_quantization, sglang_kv_cache_dtype)
SGLANG_PRECISIONS = formats().sglang_precisions
SGLANG_KV_DTYPES = formats().sglang_kv_dtypes
QUANTIZATION_FLAG = formats().sglang_quantization
KV_CACHE_DTYPE_FLAG = formats().sglang_kv_cache_dtype
DEFAULT_SAMPLING_MASK_MAX_TOKENS = 512
LOOPBACK = "127.0.0.1"


@dataclass(frozen=True, kw_only=True)
class SGLangLaunchSpec:
    """One SGLang replica: what `python -m sglang.launch_server` needs."""

    model_path: str                              # Hugging Face layout checkpoint folder (BF16 weights)
    port: int
    host: str = LOOPBACK
    tp_size: int = 1                             # GPUs per replica
    dp_size: int = 1                             # attention data-parallel groups (--dp-size, --enable-dp-attention)
    ep_size: int = 1                             # expert-parallel size (--ep-size)
    precision: str = "bf16"                      # weights: bf16 | fp8 | nvfp4 | mxfp4
    kv_cache_dtype: str = "bf16"                 # bf16 (SGLang's auto) | fp8_e4m3
    sampling_mask_max_tokens: int | None = None  # set when the trainer replays top-p masks (e.g. 512)
    weight_version: str | None = None            # --weight-version: the version the server reports at start
    enable_return_routed_experts: bool = False   # MoE: record routing so requests may ask (routing replay)
    api_key: str | None = field(default=None, repr=False)  # --api-key (never printed: `describe` masks it)
    python: str = "python"                       # interpreter on the GPU node
    extra_args: tuple[str, ...] = field(default_factory=tuple)  # appended verbatim (site-specific flags)

    def __post_init__(self) -> None:
        where = "sglang launch"
        if not isinstance(self.model_path, str) or not self.model_path:
            raise ValueError(f"{where}: model_path = {self.model_path!r}; allowed: a checkpoint path")
        if not isinstance(self.port, int) or isinstance(self.port, bool) or not 1 <= self.port <= 65535:
            raise ValueError(f"{where}: port = {self.port!r}; allowed: 1..65535")
        if not isinstance(self.tp_size, int) or isinstance(self.tp_size, bool) or self.tp_size < 1:
            raise ValueError(f"{where}: tp_size = {self.tp_size!r}; allowed: an integer >= 1")
        for name in ("dp_size", "ep_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1 or self.tp_size % v:
                raise ValueError(f"{where}: {name} = {v!r}; allowed: a divisor of tp_size ({self.tp_size})")
        if self.precision not in SGLANG_PRECISIONS:
            raise ValueError(f"{where}: precision = {self.precision!r}; allowed: {', '.join(SGLANG_PRECISIONS)}")
        if self.kv_cache_dtype not in SGLANG_KV_DTYPES:
            raise ValueError(f"{where}: kv_cache_dtype = {self.kv_cache_dtype!r}; "
                             f"allowed: {', '.join(SGLANG_KV_DTYPES)}")
        m = self.sampling_mask_max_tokens
        if m is not None and (not isinstance(m, int) or isinstance(m, bool) or m < 1):
            raise ValueError(f"{where}: sampling_mask_max_tokens = {m!r}; allowed: an integer >= 1 or None")


def launch_argv(spec: SGLangLaunchSpec, *, api_key_file: str | None = None) -> list[str]:
    """The exact command line of one SGLang replica. With `api_key_file` (a YAML file holding `api-key`, see
    `write_api_key_config`) the key is passed as `--config FILE` instead of `--api-key KEY`."""
    argv = [spec.python, "-m", "sglang.launch_server", "--model-path", spec.model_path, "--host", spec.host,
            "--port", str(spec.port), "--tp-size", str(spec.tp_size)]
    if spec.dp_size > 1:
        argv += ["--dp-size", str(spec.dp_size), "--enable-dp-attention"]
    if spec.ep_size > 1:
        argv += ["--ep-size", str(spec.ep_size)]
    quant = QUANTIZATION_FLAG[spec.precision]
    if quant is not None:
        argv += ["--quantization", quant]
    if KV_CACHE_DTYPE_FLAG[spec.kv_cache_dtype] != "auto":
        argv += ["--kv-cache-dtype", KV_CACHE_DTYPE_FLAG[spec.kv_cache_dtype]]
    if spec.sampling_mask_max_tokens is not None:
        argv += ["--sampling-mask-max-tokens", str(spec.sampling_mask_max_tokens)]
    if spec.weight_version is not None:
        argv += ["--weight-version", spec.weight_version]
    if spec.enable_return_routed_experts:
        argv += ["--enable-return-routed-experts"]
    if spec.api_key is not None:
        argv += ["--config", api_key_file] if api_key_file is not None else ["--api-key", spec.api_key]
    return argv + list(spec.extra_args)


def write_api_key_config(api_key: str, *, directory: str | Path | None = None) -> Path:
    """A new private (0600) YAML file `api-key: KEY` for SGLang's `--config`; the caller removes it. JSON
    quoting makes the value a plain YAML string whatever its characters."""
    fd, name = tempfile.mkstemp(prefix="mixfleet-sglang-key-", suffix=".yaml",
                                dir=str(directory) if directory is not None else None)
    try:
        with os.fdopen(fd, "w") as f:                 # mkstemp creates it 0600, readable by this user only
            f.write(f"api-key: {json.dumps(api_key)}\n")
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(name)
        raise
    return Path(name)


def _field(group: Any, name: str, default: Any = None) -> Any:
    if isinstance(group, Mapping):
        return group.get(name, default)
    return getattr(group, name, default)


def spec_for_replica(launch: ReplicaLaunch, *, model_path: str, port: int, host: str = LOOPBACK,
                     **kw: Any) -> SGLangLaunchSpec:
    """The launch spec of one SGLang replica from its launch record (runner/sampler/replica.py), the one
    derivation of `SGLangLaunchSpec` from a group's settings: layout, weight format and KV dtype, the top-p mask
    flag, the version it reports at start, routing capture and the run's key. `model_path`: the node-local
    checkpoint it loads; `kw`: the spec's site fields (`python`, `extra_args`)."""
    return SGLangLaunchSpec(model_path=str(model_path), port=port, host=host, tp_size=launch.tp,
                            dp_size=launch.dp_attention, ep_size=launch.ep, precision=launch.precision,
                            kv_cache_dtype=launch.kv_dtype,
                            sampling_mask_max_tokens=DEFAULT_SAMPLING_MASK_MAX_TOKENS if launch.top_p_replay
                            else None, weight_version=launch.weight_version,
                            enable_return_routed_experts=launch.routed_experts, api_key=launch.api_key, **kw)


def spec_for_group(group: Any, *, model_path: str, port: int, tp_size: int | None = None,
                   top_p_replay: bool = False, host: str = LOOPBACK, weight_version: str | None = None,
                   enable_return_routed_experts: bool = False, api_key: str | None = None,
                   **kw: Any) -> SGLangLaunchSpec:
    """The launch spec of one replica of a plan group (a `GroupPlan` or a mapping with its fields: name,
    precision, kv_dtype, tp, and the layout's dp_attention and ep), through `spec_for_replica`. `tp_size`
    overrides the group's `tp`; a group with tp = 0 ("the smallest that fits", decided by the cost model)
    needs it."""
    tp = tp_size if tp_size is not None else _field(group, "tp", 1)
    name = _field(group, "name", "?")
    if not tp:
        raise ValueError(f"plan group '{name}': tp = 0 (auto); pass tp_size resolved by the cost model")
    launch = ReplicaLaunch(group=str(name), index=0, mode="sglang", precision=_field(group, "precision"),
                           kv_dtype=_field(group, "kv_dtype", "bf16"), tp=int(tp),
                           dp_attention=int(_field(group, "dp_attention", 1) or 1),
                           ep=int(_field(group, "ep", 1) or 1), model_path=str(model_path),
                           weight_version=weight_version, top_p_replay=top_p_replay,
                           routed_experts=enable_return_routed_experts, api_key=api_key)
    return spec_for_replica(launch, model_path=str(model_path), port=port, host=host, **kw)


def argv_for_group(group: Any, *, model_path: str, port: int, tp_size: int | None = None,
                   top_p_replay: bool = False, host: str = LOOPBACK, **kw: Any) -> list[str]:
    """`launch_argv(spec_for_group(...))`: the command for one replica of a plan group."""
    return launch_argv(spec_for_group(group, model_path=model_path, port=port, tp_size=tp_size,
                                      top_p_replay=top_p_replay, host=host, **kw))


@dataclass(frozen=True, kw_only=True)
class AttachedSampler:
    """A running sampler found at a URL, as it describes itself."""

    url: str
    model_path: str
    weight_version: str
    model_info: dict
    server_info: dict                           # {} when the server does not answer /get_server_info

    @property
    def is_embedded(self) -> bool:
        return isinstance(self.server_info.get("mixfleet"), Mapping)


class AttachError(RuntimeError):
    """No usable sampler at the URL (with the reason)."""


def attach(url: str, *, timeout_s: float = 10.0, wait_s: float = 0.0,
           expect_model_path: str | None = None, api_key: str | None = None) -> AttachedSampler:
    """Check that a sampler serves at `url` (/health 200, /model_info a generation model) and describe it.

    `wait_s` > 0 keeps polling /health that long (a server still loading answers 503). `api_key`: the key
    the server was started with (sent as "Authorization: Bearer <key>")."""
    base = url.rstrip("/")
    deadline = time.monotonic() + wait_s
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    with httpx.Client(base_url=base, timeout=timeout_s, trust_env=False, headers=headers) as http:
        while True:
            try:
                status = http.get("/health").status_code
                reason = f"/health answered HTTP {status}"
            except httpx.HTTPError as e:
                status, reason = 0, f"{type(e).__name__}: {e}"
            if status == 200:
                break
            if time.monotonic() >= deadline:
                raise AttachError(f"{base}: not a healthy sampler ({reason})")
            time.sleep(0.2)
        try:
            r = http.get("/get_model_info")
            if r.status_code == 404:
                r = http.get("/model_info")
            r.raise_for_status()
            info = r.json()
        except (httpx.HTTPError, ValueError) as e:
            raise AttachError(f"{base}: /model_info failed: {e}") from e
        if not isinstance(info, dict) or not info.get("is_generation", False):
            raise AttachError(f"{base}: /model_info does not describe a generation model: {str(info)[:200]}")
        if expect_model_path is not None and info.get("model_path") != expect_model_path:
            raise AttachError(f"{base}: serves {info.get('model_path')!r}, expected {expect_model_path!r}")
        server_info: dict = {}
        try:
            r = http.get("/get_server_info")
            if r.status_code == 200 and isinstance(r.json(), dict):
                server_info = r.json()
        except (httpx.HTTPError, ValueError):
            pass
    return AttachedSampler(url=base, model_path=str(info.get("model_path", "")),
                           weight_version=str(info.get("weight_version", "")), model_info=info,
                           server_info=server_info)


def launch(spec: SGLangLaunchSpec, *, env: Mapping[str, str] | None = None, wait_s: float = 900.0,
           log_path: str | None = None) -> tuple[subprocess.Popen, AttachedSampler]:
    """Start one SGLang replica (this machine must have SGLang and GPUs) and wait until it serves."""
    if importlib.util.find_spec("sglang") is None:
        raise RuntimeError("SGLang is not installed here (pip install 'mixfleet[sglang]' on a GPU node); "
                           "the embedded sampler (`mixfleet serve`) needs no SGLang")
    key_file = write_api_key_config(spec.api_key) if spec.api_key is not None else None
    try:
        argv = launch_argv(spec, api_key_file=str(key_file) if key_file is not None else None)
        if argv[0] == "python":
            argv[0] = sys.executable
        out = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115 - owned by the child
        proc = subprocess.Popen(argv, env=dict(env) if env is not None else None, stdout=out,
                                stderr=subprocess.STDOUT)
        try:
            attached = attach(f"http://{spec.host}:{spec.port}", wait_s=wait_s, api_key=spec.api_key)
        except AttachError:
            proc.terminate()
            raise
    finally:
        if key_file is not None:                      # read when the server parsed its arguments
            with contextlib.suppress(OSError):
                key_file.unlink()
    return proc, attached


def describe(argv: Sequence[str]) -> str:
    """A shell-ready rendering of an argv (for logs and `--dry-run` printing); an --api-key value is shown
    as "$MIXFLEET_API_KEY" (a key never reaches a log or a terminal)."""
    import shlex

    out = [shlex.quote(a) for a in argv]
    for i, a in enumerate(argv[:-1]):
        if a == "--api-key":
            out[i + 1] = '"$MIXFLEET_API_KEY"'
    return " ".join(out)
