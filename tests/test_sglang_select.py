"""SGLang's own `select` against the embedded server.

(a) always: the three /generate calls `RuntimeEndpoint.select` makes, replayed over real HTTP against a real
    server, with every field select reads checked. Request shapes from SGLang's
    python/sglang/lang/backend/runtime_endpoint.py `select` (sgl-project/sglang commit
    00e3021e85aa3e48c38db9c56d90ef1a306a642d; the same in the sglang 0.5.23 wheel): a prefix call
    {"text", "sampling_params": {"max_new_tokens": 0}} read for meta_info.prompt_tokens; a batch of prefix + choice
    with max_new_tokens 0, temperature 0, return_logprob, return_text_in_logprobs and
    logprob_start_len = max(prompt_tokens - 2, 0), read for meta_info.input_token_logprobs ([logprob, id, text]:
    [0][-1] and [0][0] for token healing, x[0] of every entry for the normalized log-prob) and
    meta_info.output_token_logprobs; and (unconditional methods) input_ids = the scored ids with return_logprob,
    read for meta_info.input_token_logprobs.
(b) only where SGLang's frontend imports (it is never a dependency of this project; skipped otherwise): a real
    `sgl.select` program through `RuntimeEndpoint` against the server.
"""

from __future__ import annotations

import os

import httpx
import pytest
import torch
from sampler_helpers import make_checkpoint

PREFIX = "Q: Is the sky blue? A:"
CHOICES = [" yes", " no", " maybe"]
FRONTEND_ENV = "MIXFLEET_SGLANG_FRONTEND"   # a folder holding SGLang's frontend (see the last test)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from mixfleet.runner.sampler.engine import Engine
    from mixfleet.runner.sampler.engine.model import load_weights
    from mixfleet.runner.sampler.server import ServerArgs
    from mixfleet.runner.sampler.server_launch import start_in_thread

    ck = make_checkpoint(tmp_path_factory.mktemp("ck"), seed=2, weight_version="v0")
    engine = Engine(ck, precision="fp32", kv_cache_dtype="fp32", kernel="fp32")
    handle = start_in_thread(engine, server_args=ServerArgs(port=0))
    try:
        yield handle.url, engine, load_weights(ck, precision="fp32", kernel="fp32")
    finally:
        handle.stop()


def _post(url: str, body: dict):
    r = httpx.post(url + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text        # select asserts success (_assert_success)
    return r.json()


def _scores(w, engine, texts: list[str], start: int) -> list[float]:
    """Mean log-prob of positions start+1.. of each text, from one direct fp32 forward (select's normalization)."""
    from mixfleet.runner.sampler.engine.model import forward_full

    out = []
    for t in texts:
        ids = engine.tokenizer.encode(t)
        lp = torch.log_softmax(forward_full(w, ids, "fp32").double(), dim=-1)
        vals = [lp[i - 1, ids[i]].item() for i in range(start + 1, len(ids))]
        out.append(sum(vals) / len(vals))
    return out


def test_select_requests_replayed_field_by_field(setup):
    url, engine, w = setup
    first = _post(url, {"text": PREFIX, "sampling_params": {"max_new_tokens": 0}})
    prompt_len = first["meta_info"]["prompt_tokens"]
    assert prompt_len == len(engine.tokenizer.encode(PREFIX))
    start = max(prompt_len - 2, 0)
    texts = [PREFIX + c for c in CHOICES]
    obj = _post(url, {"text": texts, "sampling_params": {"max_new_tokens": 0, "temperature": 0},
                      "return_logprob": True, "return_text_in_logprobs": True, "logprob_start_len": start})
    assert isinstance(obj, list) and len(obj) == len(CHOICES)
    normalized = []
    for text, r in zip(texts, obj, strict=True):
        itl = r["meta_info"]["input_token_logprobs"]
        ids = engine.tokenizer.encode(text)
        assert len(itl) == len(ids) - start and [e[1] for e in itl] == ids[start:]
        assert all(len(e) == 3 and isinstance(e[2], str) for e in itl)
        assert itl[0][0] is None and all(isinstance(e[0], float) for e in itl[1:])
        assert r["meta_info"]["output_token_logprobs"] == []
        assert isinstance(itl[0][-1], str) and not PREFIX.endswith(itl[0][-1])   # no token-healing branch here
        values = [x[0] for x in itl if x[0]]                                    # compute_normalized_prompt_logprobs
        normalized.append(sum(values) / len(values))
    ref = _scores(w, engine, texts, start)
    assert max(abs(a - b) for a, b in zip(normalized, ref, strict=True)) < 1e-4
    # unconditional likelihood methods: the scored ids again, as input_ids, default logprob_start_len
    input_ids = [[e[1] for e in r["meta_info"]["input_token_logprobs"]] for r in obj]
    unc = _post(url, {"input_ids": input_ids, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True})
    assert [r["meta_info"]["input_token_logprobs"] for r in unc] == [[], [], []]   # SGLang 0.5.23: -1 -> none


def test_real_sglang_frontend_select(setup, monkeypatch):
    """Needs SGLang's frontend importable: installed, or a `pip install --no-deps --target DIR` copy named by
    MIXFLEET_SGLANG_FRONTEND (.ci/run makes one: sglang 0.5.6 and the packages its import needs). Where that
    variable is set the test fails instead of skipping."""
    folder = os.environ.get(FRONTEND_ENV, "")
    if folder:
        monkeypatch.syspath_prepend(folder)
    try:
        import sglang as sgl
        from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint
    except Exception as e:   # not installed, or its imports need packages this machine lacks
        if folder:
            pytest.fail(f"{FRONTEND_ENV}={folder}: SGLang's frontend does not import ({type(e).__name__}: {e})")
        pytest.skip(f"SGLang's frontend does not import here ({type(e).__name__}: {e})")
    url, engine, w = setup

    @sgl.function
    def pick(s):
        s += PREFIX
        s += sgl.select("answer", choices=CHOICES)

    state = pick.run(backend=RuntimeEndpoint(url))
    start = max(len(engine.tokenizer.encode(PREFIX)) - 2, 0)
    ref = _scores(w, engine, [PREFIX + c for c in CHOICES], start)
    meta = state.get_meta_info("answer")
    assert max(abs(a - b) for a, b in zip(meta["normalized_prompt_logprobs"], ref, strict=True)) < 1e-4
    assert state["answer"] == CHOICES[max(range(len(CHOICES)), key=lambda i: ref[i])]
