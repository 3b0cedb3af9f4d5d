"""Shared helpers of the sampler server/client tests: tiny checkpoints, a real engine served on loopback.

`served_engine` starts the real embedded `Engine` on a tiny seeded checkpoint behind the real
uvicorn server on 127.0.0.1 (a free port, a background thread), so the protocol tests exercise
real HTTP end to end.
"""

from __future__ import annotations

import json
import math
from contextlib import contextmanager
from pathlib import Path

import httpx
from mixfleet.costmodel.specs.model import load_model_spec


def make_checkpoint(directory: Path, *, seed: int, weight_version: str) -> Path:
    """A seeded random checkpoint of the tiny model spec (with its tokenizer)."""
    from mixfleet.runner.checkpoint.init_model import init_model

    return Path(init_model(load_model_spec("tiny"), directory, seed=seed, weight_version=weight_version))


@contextmanager
def served_engine(checkpoint: Path, **server_kw):
    """(engine, base_url) of a real Engine served over HTTP on loopback for the duration of the block."""
    from mixfleet.runner.sampler.engine import Engine
    from mixfleet.runner.sampler.server import ServerArgs
    from mixfleet.runner.sampler.server_launch import start_in_thread

    engine = Engine(checkpoint, precision="bf16", kv_cache_dtype="bf16", kernel="fp32", max_running_requests=64)
    handle = start_in_thread(engine, server_args=ServerArgs(port=0, **server_kw))
    try:
        yield engine, handle.url
    finally:
        handle.stop()


def sse_chunks(resp: httpx.Response | list[str]) -> tuple[list[dict], bool]:
    """Parse a server-sent-events body: (chunks, saw [DONE])."""
    lines = resp if isinstance(resp, list) else resp.text.splitlines()
    chunks, done = [], False
    for line in lines:
        if not line.startswith("data: "):
            assert line == "", f"unexpected SSE line {line!r}"
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            done = True
            continue
        assert not done, "data after [DONE]"
        chunks.append(json.loads(data))
    return chunks, done


def logsumexp(xs: list[float]) -> float:
    m = max(xs)
    return m + math.log(sum(math.exp(x - m) for x in xs))
