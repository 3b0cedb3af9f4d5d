"""Issue 24 (the second probe): the sampler server's HTTP cases, the SGLang launcher's API key, the workload bounds.

Real servers over real HTTP on 127.0.0.1 (the embedded engine on a tiny checkpoint, `sampler_helpers`). Each test
is the probe's reproduction: on main a lone surrogate was a 500 with a reset connection, a web page's
cross-origin `text/plain` POST (and a DNS-rebinding Host) drove `/update_weights_from_disk`, the API key of a
launched SGLang server was on its command line, and a workload's `turns = uniform 2..1e8` loaded (the dry run then
grew to 19.8 GB).
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import httpx
import pytest
from mixfleet.costmodel import limits
from mixfleet.costmodel.errors import SpecError
from mixfleet.costmodel.specs.dist import Dist
from mixfleet.costmodel.specs.workload import load_workload, workload_from_dict
from sampler_helpers import make_checkpoint, served_engine

GEN = {"input_ids": [1, 5, 6], "sampling_params": {"max_new_tokens": 2}}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("probe2-serve")
    ckpt = make_checkpoint(root / "ck", seed=0, weight_version="3")
    other = make_checkpoint(root / "other", seed=1, weight_version="99")
    with served_engine(ckpt) as (engine, url):
        yield engine, url, other


def _post(url: str, path: str, body: bytes, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(url + path, content=body, headers={"content-type": "application/json", **(headers or {})},
                      timeout=120, trust_env=False)


# ---- a lone surrogate: 400 naming the field (was 500 and a reset connection) ---------------------------------
@pytest.mark.parametrize("body, field", [
    (b'{"text": "\\ud800", "sampling_params": {"max_new_tokens": 2}}', "text"),
    (b'{"text": ["ok", "a\\udfffb"], "sampling_params": {"max_new_tokens": 2}}', "text[1]"),
    (b'{"input_ids": [1, 5], "rid": "\\udfff", "sampling_params": {"max_new_tokens": 2}}', "rid"),
    (b'{"input_ids": [1, 5], "sampling_params": {"max_new_tokens": 2, "stop": ["\\ud83d"]}}',
     "sampling_params.stop[0]"),
    ('{"text": "raw \udcff bytes"}'.encode("utf-8", "surrogatepass"), "text"),      # ED B3 BF: a raw surrogate
])
def test_a_lone_surrogate_is_a_400_naming_the_field(server, body: bytes, field: str) -> None:
    _engine, url, _other = server
    r = _post(url, "/generate", body)
    assert r.status_code == 400, r.text
    msg = r.json()["error"]["message"]
    assert msg.startswith(f"{field}: holds a lone UTF-16 surrogate"), msg
    assert "allowed: valid Unicode text" in msg
    ok = _post(url, "/generate", b'{"text": "pair \\ud83d\\ude00 ok", "sampling_params": {"max_new_tokens": 2}}')
    assert ok.status_code == 200, ok.text                      # a surrogate pair is valid text; the server serves on


def test_a_surrogate_in_a_control_body_is_a_400_too(server) -> None:
    engine, url, _other = server
    r = _post(url, "/update_weight_version", b'{"new_version": "\\ud800"}')
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("new_version: holds a lone")
    assert str(engine.weight_version) == "3"


# ---- a web page cannot drive a local server ------------------------------------------------------------------
def test_a_cross_origin_text_plain_post_cannot_load_weights(server) -> None:
    """The probe: a page on another site POSTs text/plain (no CORS preflight) to /update_weights_from_disk."""
    engine, url, other = server
    body = json.dumps({"model_path": str(other), "weight_version": "99"}).encode()
    r = httpx.post(url + "/update_weights_from_disk", content=body, timeout=120, trust_env=False,
                   headers={"content-type": "text/plain;charset=UTF-8", "origin": "http://evil.example",
                            "sec-fetch-site": "cross-site", "sec-fetch-mode": "no-cors"})
    assert r.status_code == 403, r.text
    assert "Origin 'http://evil.example' is not this sampler's own origin" in r.json()["error"]["message"]
    assert str(engine.weight_version) == "3"                   # on main: 200, and the server served version 99


def test_dns_rebinding_host_is_refused(server) -> None:
    """A page of evil.example whose name was rebound to 127.0.0.1: same origin for the browser, but Host is not
    a loopback name."""
    engine, url, other = server
    port = url.rsplit(":", 1)[1]
    body = json.dumps({"model_path": str(other), "weight_version": "99"}).encode()
    r = _post(url, "/update_weights_from_disk", body,
              {"host": f"evil.example:{port}", "origin": f"http://evil.example:{port}"})
    assert r.status_code == 403, r.text
    msg = r.json()["error"]["message"]
    assert f"Host header 'evil.example:{port}' is not a loopback name" in msg and "--host" in msg
    r = httpx.get(url + "/get_server_info", headers={"host": "evil.example"}, timeout=60, trust_env=False)
    assert r.status_code == 403                                # reads too: a rebound page reads nothing
    assert str(engine.weight_version) == "3"


@pytest.mark.parametrize("headers, status, message", [
    ({"sec-fetch-site": "cross-site"}, 403, "Sec-Fetch-Site = 'cross-site'"),
    ({"sec-fetch-site": "same-site"}, 403, "Sec-Fetch-Site = 'same-site'"),        # another port on localhost
    ({"origin": "null"}, 403, "Origin 'null'"),                                      # a sandboxed frame, file://
    ({"content-type": "text/plain"}, 400, "Content-Type = 'text/plain': a POST body must be JSON"),
    ({"content-type": "application/x-www-form-urlencoded"}, 400, "allowed: application/json"),
    ({"content-type": "multipart/form-data; boundary=x"}, 400, "must be JSON"),
])
def test_page_like_requests_are_refused(server, headers: dict, status: int, message: str) -> None:
    _engine, url, _other = server
    r = _post(url, "/generate", json.dumps(GEN).encode(), headers)
    assert r.status_code == status, r.text
    assert message in r.json()["error"]["message"]


@pytest.mark.parametrize("headers", [
    {},                                                        # the runner's client, curl with the JSON header
    {"content-type": "application/json; charset=utf-8"},
    {"host": "localhost"}, {"host": "127.0.0.2"}, {"host": "mixfleet.localhost"},
    {"sec-fetch-site": "same-origin"}, {"sec-fetch-site": "none"},                   # the address bar, same page
])
def test_local_clients_are_served(server, headers: dict) -> None:
    _engine, url, _other = server
    r = _post(url, "/generate", json.dumps(GEN).encode(), headers)
    assert r.status_code == 200, r.text
    own = _post(url, "/generate", json.dumps(GEN).encode(), {"origin": url})         # its own origin
    assert own.status_code == 200, own.text
    raw = httpx.post(url + "/generate", content=json.dumps(GEN).encode(), timeout=120, trust_env=False)
    assert raw.status_code == 200 and "content-type" not in raw.request.headers       # no Content-Type at all


def test_a_server_bound_elsewhere_takes_any_host_but_no_foreign_origin() -> None:
    from mixfleet.runner.sampler.server import check_browser_request

    h = httpx.Headers
    assert check_browser_request("GET", h({"host": "node-7.cluster:30000"}), "10.0.0.5") is None
    assert check_browser_request("GET", h({"host": "node-7.cluster:30000"}), "127.0.0.1")[0] == 403
    refused = check_browser_request("POST", h({"host": "10.0.0.5:30000", "origin": "http://evil.example"}),
                                    "10.0.0.5")
    assert refused is not None and refused[0] == 403
    assert check_browser_request("POST", h({"host": "[::1]:30000"}), "::1") is None


# ---- the API key of a launched SGLang server stays off its command line --------------------------------------
FAKE_SGLANG = textwrap.dedent('''
    """A stand-in for `python -m sglang.launch_server` that reads `--config FILE.yaml` as SGLang's
    ConfigArgumentMerger does (keys are flag names, '-' or '_'), and serves the embedded engine with that key."""
    import argparse, sys
    import yaml
    from mixfleet.runner.sampler.engine import Engine
    from mixfleet.runner.sampler.server import ServerArgs, serve

    p = argparse.ArgumentParser()
    for flag in ("--model-path", "--host", "--config", "--api-key"):
        p.add_argument(flag)
    p.add_argument("--port", type=int)
    p.add_argument("--tp-size", type=int)
    a, _ = p.parse_known_args()
    cfg = {k.replace("-", "_"): v for k, v in (yaml.safe_load(open(a.config)) if a.config else {}).items()}
    key = a.api_key or cfg.get("api_key")
    serve(Engine(a.model_path, precision="bf16", kv_cache_dtype="bf16", kernel="fp32"),
          server_args=ServerArgs(host=a.host, port=a.port, api_key=key))
''')


def test_launched_sglang_gets_its_key_outside_argv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mixfleet.runner.sampler.sglang_launch import SGLangLaunchSpec, launch, launch_argv

    key = "k" * 20 + "-secret-of-this-run"
    spec = SGLangLaunchSpec(model_path="/m", port=30001, api_key=key)
    argv = launch_argv(spec, api_key_file="/run/k.yaml")
    assert key not in " ".join(argv) and "--api-key" not in argv
    assert argv[-2:] == ["--config", "/run/k.yaml"]

    pkg = tmp_path / "fake" / "sglang"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "launch_server.py").write_text(FAKE_SGLANG)
    monkeypatch.syspath_prepend(str(tmp_path / "fake"))
    ckpt = make_checkpoint(tmp_path / "ck", seed=0, weight_version="0")
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "fake"), *sys.path])}
    proc, found = launch(SGLangLaunchSpec(model_path=str(ckpt), port=port, api_key=key), env=env, wait_s=180)
    try:
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes().decode()
        assert key not in cmdline and "--config" in cmdline                    # what `ps` shows
        config_file = cmdline.split("\0")[cmdline.split("\0").index("--config") + 1]
        assert not Path(config_file).exists()                                  # read at start, then removed
        assert found.model_path == str(ckpt)                                   # attach() sent the key: it read info
        base = f"http://127.0.0.1:{port}"
        assert httpx.get(base + "/get_model_info", trust_env=False, timeout=30).status_code == 401
        assert httpx.get(base + "/get_model_info", headers={"Authorization": f"Bearer {key}"},
                         trust_env=False, timeout=30).status_code == 200
    finally:
        proc.terminate()
        proc.wait(30)


def test_the_key_file_is_private_and_valid_yaml(tmp_path: Path) -> None:
    import stat

    import yaml
    from mixfleet.runner.sampler.sglang_launch import write_api_key_config

    key = "abc_DEF-123" * 3
    path = write_api_key_config(key, directory=tmp_path)
    try:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.suffix == ".yaml"
        assert yaml.safe_load(path.read_text()) == {"api-key": key}
    finally:
        path.unlink()


# ---- workload distributions are bounded (BAD 5) --------------------------------------------------------------
def _tiny(**dists: object) -> dict:
    return {**load_workload("tiny-cpu").to_dict(), **dists}


def test_the_probes_turns_uniform_2_to_1e8_is_refused_naming_the_limit() -> None:
    """main: loaded; `simulate -n 1` then grew to 19.8 GB in 120 s (a MemoryError under a ulimit)."""
    with pytest.raises(SpecError, match=r"turns.*'high' = 100000000\.0 is invalid; allowed: at most 4,096 "
                                        r"\(MAX_TURNS"):
        workload_from_dict(_tiny(turns={"kind": "uniform", "low": 2, "high": 1e8, "integer": True}))


@pytest.mark.parametrize("field, dist, bad, allowed", [
    ("turns", {"kind": "uniform", "low": -5, "high": 3, "integer": True}, "'low' = -5.0", "at least 0"),
    ("turns", -2, "'value' = -2.0", "at least 0"),
    ("tool_latency_s", {"kind": "uniform", "low": -1.0, "high": 0.5}, "'low' = -1.0", "at least 0"),
    ("tool_latency_s", {"kind": "lognormal", "median": 1, "sigma": 1, "min": -3}, "'min' = -3.0", "at least 0"),
    ("tool_latency_s", 10**7, "'value' = 10000000.0", "at most 86,400 (MAX_TOOL_LATENCY_S"),
    ("reply_tokens", {"kind": "empirical", "values": [10, 2e6]}, "'values' = 2000000.0",
     "at most 1,048,576 (MAX_NEW_TOKENS"),
    ("tool_output_tokens", {"kind": "uniform", "low": 1, "high": 1e12}, "'high' = 1000000000000.0",
     "at most 16,777,216 (MAX_CONTEXT_TOKENS"),
    ("prompt_tokens", {"kind": "lognormal", "median": 40, "sigma": 0.5, "max": 1e9}, "'max' = 1000000000.0",
     "at most 16,777,216 (MAX_CONTEXT_TOKENS"),
    ("prompt_tokens", {"kind": "lognormal", "median": 1e9, "sigma": 0.5}, "'median' = 1000000000.0",
     "at most 16,777,216 (MAX_CONTEXT_TOKENS"),
    ("turns", {"kind": "lognormal", "median": 3, "sigma": 40}, "'sigma' = 40.0", "at most 10 (MAX_LOGNORMAL_SIGMA"),
])
def test_every_distribution_is_bounded(field: str, dist: object, bad: str, allowed: str) -> None:
    """main: all accepted (negative turns and tool latency included; sigma 40 overflowed the planner's mean)."""
    with pytest.raises(SpecError, match=field) as e:
        workload_from_dict(_tiny(**{field: dist}))
    assert f"{bad} is invalid; allowed: {allowed}" in str(e.value), str(e.value)


def test_an_unclipped_lognormal_is_clipped_at_its_fields_limit() -> None:
    """A lognormal without `max` (allowed, the tests' workloads have them) stops at the field's limit, so its
    samples and its mean stay bounded."""
    import numpy as np

    w = workload_from_dict(_tiny(reply_tokens={"kind": "lognormal", "median": 40, "sigma": 3.0, "min": 1}))
    assert w.reply_tokens.max == limits.MAX_NEW_TOKENS
    x = w.reply_tokens.sample(np.random.default_rng(0), 200_000)
    assert x.max() <= limits.MAX_NEW_TOKENS and w.reply_tokens.mean < limits.MAX_NEW_TOKENS


def test_a_huge_integer_uniform_mean_takes_no_memory() -> None:
    """Dist.mean of an integer uniform built an array of every integer in [low, high] (1e8 of them: 800 MB, the
    probe's growth); it is closed-form now, and agrees with the array on small ranges."""
    import numpy as np

    big = Dist.uniform(2, 1e15, integer=True)
    assert big.mean == pytest.approx((2 + 1e15) / 2)
    rng = np.random.default_rng(1)
    for _ in range(300):
        lo, hi = sorted(rng.uniform(-20, 40, size=2))
        cmin, cmax = sorted(rng.uniform(-30, 50, size=2))
        kw = {k: v for k, v in (("min", cmin), ("max", cmax)) if rng.random() < 0.7}
        if np.ceil(lo) > np.floor(hi):
            continue
        d = Dist.uniform(lo, hi, integer=True, **kw)
        ints = np.arange(np.ceil(lo), np.floor(hi) + 1)
        want = np.clip(ints, kw.get("min", -np.inf), kw.get("max", np.inf)).mean()
        assert d.mean == pytest.approx(want, rel=1e-12, abs=1e-12), (lo, hi, kw)


def test_the_plan_command_refuses_the_probes_workload(tmp_path: Path) -> None:
    """`mixfleet plan --workload FILE` (the Plan page's box takes the same `workload_from_dict`): one line, exit 2.
    Run as its own process under a 3 GiB address-space limit, as the probe did: on main it ended in a MemoryError
    traceback (exit 1) there, and without a limit it grew to 19.8 GB."""
    import resource
    import subprocess

    import tomli_w

    path = tmp_path / "huge-turns.toml"
    path.write_text(tomli_w.dumps(_tiny(turns={"kind": "uniform", "low": 2, "high": 1e8, "integer": True})))

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))

    r = subprocess.run([sys.executable, "-c", "from mixfleet.ui.cli import app; app(prog_name='mixfleet')", "plan",
                        "--workload", str(path), "--model", "tiny"], capture_output=True, text=True, timeout=300,
                       preexec_fn=limit)
    out = r.stdout + r.stderr
    assert r.returncode == 2, out[-2000:]
    assert "at most 4,096 (MAX_TURNS" in out and "Traceback" not in out and "MemoryError" not in out
