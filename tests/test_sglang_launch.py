"""runner/sampler/sglang_launch.py: the exact SGLang command per plan group, and attaching to servers by URL.

The command lines are checked token by token (PROTOCOL.md's flags per precision / KV dtype / TP,
the mask flag only with top-p replay). `attach` is exercised against a real embedded server on
loopback and against a port where nothing listens.
"""

from __future__ import annotations

import socket

import pytest
from mixfleet.runner.sampler.sglang_launch import (
    AttachError,
    SGLangLaunchSpec,
    argv_for_group,
    attach,
    describe,
    launch_argv,
    spec_for_group,
)
from sampler_helpers import make_checkpoint, served_engine

BASE = ["python", "-m", "sglang.launch_server", "--model-path", "/ckpt/v3", "--host", "127.0.0.1", "--port", "30001"]


@pytest.mark.parametrize("precision, kv, tp, replay, tail", [
    ("bf16", "bf16", 1, False, ["--tp-size", "1"]),
    ("fp8", "bf16", 2, False, ["--tp-size", "2", "--quantization", "fp8"]),
    ("nvfp4", "fp8_e4m3", 1, False, ["--tp-size", "1", "--quantization", "modelopt_fp4", "--kv-cache-dtype",
                                     "fp8_e4m3"]),
    ("mxfp4", "fp8_e4m3", 4, True, ["--tp-size", "4", "--quantization", "mxfp4", "--kv-cache-dtype", "fp8_e4m3",
                                    "--sampling-mask-max-tokens", "512"]),
    ("bf16", "fp8_e4m3", 8, True, ["--tp-size", "8", "--kv-cache-dtype", "fp8_e4m3",
                                   "--sampling-mask-max-tokens", "512"]),
])
def test_argv_per_group(precision, kv, tp, replay, tail):
    group = {"name": "g", "precision": precision, "kv_dtype": kv, "tp": tp}
    assert argv_for_group(group, model_path="/ckpt/v3", port=30001, top_p_replay=replay) == BASE + tail


def test_group_objects_and_overrides():
    class Group:                       # the attributes a plan's GroupPlan carries
        name, precision, kv_dtype, tp = "B200-NVFP4", "nvfp4", "fp8_e4m3", 0

    with pytest.raises(ValueError, match="plan group 'B200-NVFP4': tp = 0 \\(auto\\); pass tp_size"):
        spec_for_group(Group(), model_path="/m", port=1)
    spec = spec_for_group(Group(), model_path="/m", port=31000, tp_size=2, weight_version="5",
                          extra_args=("--mem-fraction-static", "0.8"))
    assert launch_argv(spec) == ["python", "-m", "sglang.launch_server", "--model-path", "/m", "--host", "127.0.0.1",
                                 "--port", "31000", "--tp-size", "2", "--quantization", "modelopt_fp4",
                                 "--kv-cache-dtype", "fp8_e4m3", "--weight-version", "5", "--mem-fraction-static",
                                 "0.8"]
    assert describe(["python", "-m", "x", "--model-path", "/a b"]) == "python -m x --model-path '/a b'"


@pytest.mark.parametrize("kw, message", [
    ({"precision": "int4"}, "precision = 'int4'; allowed: bf16, fp8, nvfp4, mxfp4"),
    ({"kv_cache_dtype": "fp8_e5m2"}, "kv_cache_dtype = 'fp8_e5m2'; allowed: bf16, fp8_e4m3"),
    ({"tp_size": 0}, "tp_size = 0; allowed: an integer >= 1"),
    ({"port": 70000}, "port = 70000; allowed: 1..65535"),
    ({"sampling_mask_max_tokens": 0}, "sampling_mask_max_tokens = 0"),
])
def test_spec_validation(kw, message):
    with pytest.raises(ValueError, match=message):
        SGLangLaunchSpec(**{"model_path": "/m", "port": 30000, **kw})


def test_attach(tmp_path):
    ckpt = make_checkpoint(tmp_path / "ck", seed=0, weight_version="4")
    with served_engine(ckpt) as (_engine, url):
        found = attach(url + "/")
        assert found.url == url and found.model_path == str(ckpt) and found.weight_version == "4"
        assert found.model_info["is_generation"] is True and found.is_embedded
        assert found.server_info["tp_size"] == 1
        with pytest.raises(AttachError, match="serves .* expected '/elsewhere'"):
            attach(url, expect_model_path="/elsewhere")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(AttachError, match=f"http://127.0.0.1:{port}: not a healthy sampler \\(ConnectError"):
        attach(f"http://127.0.0.1:{port}", timeout_s=1.0)


def test_a_plan_layout_reaches_the_sglang_command():
    from mixfleet.policies.plan import GroupPlan

    g = GroupPlan(name="H200-FP8-DEP8", accelerator="H200", precision="fp8", tp=8, dp_attention=8, ep=8)
    argv = argv_for_group(g, model_path="/ckpt/v3", port=30001)
    assert argv[len(BASE):len(BASE) + 7] == ["--tp-size", "8", "--dp-size", "8", "--enable-dp-attention",
                                             "--ep-size", "8"]
    with pytest.raises(ValueError, match="dp_size = 3; allowed: a divisor of tp_size"):
        SGLangLaunchSpec(model_path="/m", port=1, tp_size=8, dp_size=3)
