"""The engine's scheduling and control on the tiny model: continuous batching gives the outputs of
running each request alone, the KV-token budget holds requests back, in-flight weight updates tag
tokens with their version (and failed loads change nothing), prefix reuse, abort, pause modes, and
the engine thread driven from other threads."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from mixfleet.costmodel.specs.model import load_model_spec
from mixfleet.runner.checkpoint.hf_checkpoint import load_checkpoint, save_checkpoint
from mixfleet.runner.checkpoint.init_model import init_model
from mixfleet.runner.checkpoint.tokenizer import ByteTokenizer
from mixfleet.runner.sampler.engine import Engine
from mixfleet.runner.sampler.engine_api import EngineRequest, RequestResult, SamplingParams, TokenOutput

TOK = ByteTokenizer()


pytestmark = pytest.mark.usefixtures("one_torch_thread")   # tests/conftest.py


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("ck")
    spec = load_model_spec("tiny")
    return init_model(spec, d / "v0", seed=0), init_model(spec, d / "v7", seed=1, weight_version="7")


def fp32(path: Path, **kw) -> Engine:
    return Engine(path, precision="fp32", kv_cache_dtype="fp32", **kw)


def prompt(i: int) -> list[int]:
    return TOK.encode(f"<|user|>Request number {i}{'!' * i}<|assistant|>")


def req(rid: str, ids: list[int], n: int = 10, temperature: float = 0.0, seed: int | None = None,
        session: str | None = None) -> EngineRequest:
    return EngineRequest(rid=rid, input_ids=ids, session_id=session, return_logprob=True,
                         params=SamplingParams(max_new_tokens=n, temperature=temperature, sampling_seed=seed,
                                               ignore_eos=True))


class Collector:
    def __init__(self) -> None:
        self.results: dict[str, RequestResult] = {}
        self.tokens: dict[str, list[TokenOutput]] = {}

    def add(self, engine: Engine, r: EngineRequest) -> None:
        engine.add_request(r, on_finish=lambda res: self.results.__setitem__(res.rid, res),
                           on_token=lambda t: self.tokens.setdefault(r.rid, []).append(t))


def drain(engine: Engine, limit: int = 10_000) -> None:
    for _ in range(limit):
        if not engine.step():
            return


def alone(path: Path, r: EngineRequest) -> RequestResult:
    eng, c = fp32(path), Collector()
    c.add(eng, r)
    drain(eng)
    return c.results[r.rid]


def test_continuous_batching_equals_running_alone(ckpts) -> None:
    ck, _ = ckpts
    reqs = [req("g0", prompt(0), 12), req("s1", prompt(1), 9, temperature=1.0, seed=11),
            req("g2", prompt(2), 5), req("s3", prompt(3), 14, temperature=0.7, seed=3), req("g4", prompt(4), 7)]
    eng, c = fp32(ck), Collector()
    batch_sizes = []
    plan = {0: reqs[:2], 3: reqs[2:4], 5: reqs[4:]}        # requests join between decode steps
    for step in range(200):
        for r in plan.get(step, []):
            c.add(eng, r)
        did = eng.step()
        batch_sizes.append(eng.load()["num_running_reqs"])
        if not did and step > 5:
            break
    assert max(batch_sizes) >= 3
    for r in reqs:
        ref = alone(ck, r)
        assert c.results[r.rid].output_ids == ref.output_ids, r.rid
        assert [t.logprob for t in c.results[r.rid].tokens] == pytest.approx([t.logprob for t in ref.tokens],
                                                                              abs=1e-4)


def test_kv_budget_holds_requests_back(ckpts) -> None:
    ck, _ = ckpts
    reqs = [req(f"b{i}", prompt(i), 10) for i in range(4)]
    per_req = max(len(r.input_ids) + 10 for r in reqs)
    eng, c = fp32(ck, max_total_tokens=2 * per_req), Collector()
    for r in reqs:
        c.add(eng, r)
    eng.step()
    load = eng.load()
    assert load["num_running_reqs"] == 2 and load["num_waiting_reqs"] == 2
    assert load["max_total_num_tokens"] == 2 * per_req
    assert 0 < load["num_used_tokens"] <= 2 * per_req and load["token_usage"] == pytest.approx(
        load["num_used_tokens"] / (2 * per_req))
    drain(eng)
    assert eng.load()["num_running_reqs"] == 0 and eng.load()["num_used_tokens"] == 0
    for r in reqs:
        assert c.results[r.rid].output_ids == alone(ck, r).output_ids
    # a batch-size limit does the same
    eng1, c1 = fp32(ck, max_running_requests=1), Collector()
    for r in reqs[:2]:
        c1.add(eng1, r)
    eng1.step()
    assert eng1.load()["num_running_reqs"] == 1 and eng1.load()["num_waiting_reqs"] == 1
    drain(eng1)
    assert set(c1.results) == {"b0", "b1"}


def test_weight_update_mid_generation_tags_tokens(ckpts) -> None:
    v0, v7 = ckpts
    eng, c = fp32(v0), Collector()
    c.add(eng, req("w", prompt(0), 12))
    for _ in range(3):
        eng.step()
    n_before = len(c.tokens["w"])
    assert 0 < n_before < 12 and eng.weight_version == "0"
    ok, msg = eng.update_weights_from_disk(v7)
    assert ok, msg
    assert eng.weight_version == "7" and eng.model_path == str(v7)
    drain(eng)
    res = c.results["w"]
    assert [t.weight_version for t in res.tokens] == ["0"] * n_before + ["7"] * (12 - n_before)
    assert res.weight_version == "7" and len(res.output_ids) == 12
    # an explicit version wins over the checkpoint's
    assert eng.update_weights_from_disk(v0, "v2")[0] and eng.weight_version == "v2"


def test_weight_update_before_decoding_serves_the_new_weights(ckpts) -> None:
    v0, v7 = ckpts
    eng, c = fp32(v0), Collector()
    c.add(eng, req("n", prompt(1), 8))
    assert eng.update_weights_from_disk(v7)[0]
    drain(eng)
    assert c.results["n"].output_ids == alone(v7, req("n", prompt(1), 8)).output_ids
    assert c.results["n"].output_ids != alone(v0, req("n", prompt(1), 8)).output_ids


def test_failed_weight_loads_keep_old_weights(ckpts, tmp_path: Path) -> None:
    v0, _ = ckpts
    cfg, tensors = load_checkpoint(v0)
    # another architecture (2 layers)
    small = init_model(load_model_spec("tiny").__class__(**{**load_model_spec("tiny").__dict__, "num_layers": 2}),
                       tmp_path / "small")
    # the right config but a tensor of the wrong shape written behind save_checkpoint's back
    broken = save_checkpoint(tmp_path / "broken", cfg, tensors)
    from safetensors.torch import save_file
    bad = dict(tensors)
    bad["model.norm.weight"] = torch.ones(7)
    save_file(bad, str(broken / "model.safetensors"))

    eng, c = fp32(v0), Collector()
    c.add(eng, req("f", prompt(2), 10))
    eng.step()
    for path, words in ((tmp_path / "missing", "no config.json"), (small, "architecture differs"),
                        (broken, "model.norm.weight")):
        ok, msg = eng.update_weights_from_disk(path, "bad")
        assert not ok and words in msg, msg
        assert eng.weight_version == "0" and eng.model_path == str(v0)
    drain(eng)
    res = c.results["f"]
    assert {t.weight_version for t in res.tokens} == {"0"}
    assert res.output_ids == alone(v0, req("f", prompt(2), 10)).output_ids


def test_prefix_reuse_for_a_session(ckpts) -> None:
    v0, v7 = ckpts
    eng, c = fp32(v0), Collector()
    p1 = prompt(5)
    c.add(eng, req("t1", p1, 10, session="s"))
    drain(eng)
    t1 = c.results["t1"]
    assert t1.cached_tokens == 0
    p2 = p1 + t1.output_ids + TOK.encode("<|user|>and then?<|assistant|>")
    c.add(eng, req("t2", p2, 10, session="s"))
    drain(eng)
    t2 = c.results["t2"]
    assert t2.cached_tokens == len(p1) + len(t1.output_ids) - 1      # the last output token has no KV yet
    assert t2.output_ids == alone(v0, req("x", p2, 10)).output_ids
    # another session gets nothing; a diverging prompt reuses only the common prefix
    c.add(eng, req("o", p2, 3, session="other"))
    c.add(eng, req("t3", p1[:4] + TOK.encode("different"), 3, session="s"))
    drain(eng)
    assert c.results["o"].cached_tokens == 0
    assert c.results["t3"].cached_tokens == 4
    # a weight update drops the cached KV (it came from the old weights)
    c.add(eng, req("t4", p1 + [20], 3, session="o"))
    drain(eng)
    assert eng.update_weights_from_disk(v7)[0]
    c.add(eng, req("t5", p1 + [20, 21], 3, session="o"))
    drain(eng)
    assert c.results["t5"].cached_tokens == 0
    assert eng.flush_cache()


def test_abort_running_waiting_and_all(ckpts) -> None:
    ck, _ = ckpts
    eng, c = fp32(ck, max_running_requests=2), Collector()
    for i in range(4):
        c.add(eng, req(f"a{i}", prompt(i), 20))
    for _ in range(3):
        eng.step()
    assert eng.abort("a0") == 1 and eng.abort("a3") == 1 and eng.abort("nope") == 0
    a0, a3 = c.results["a0"], c.results["a3"]
    assert a0.finish_reason["type"] == "abort" and 0 < len(a0.output_ids) < 20
    assert a0.tokens == c.tokens["a0"] and [t.token_id for t in a0.tokens] == a0.output_ids
    assert a3.finish_reason["type"] == "abort" and a3.output_ids == []           # still waiting
    drain(eng)
    for rid in ("a1", "a2"):
        assert c.results[rid].output_ids == alone(ck, req(rid, prompt(int(rid[1])), 20)).output_ids
    for i in range(3):
        c.add(eng, req(f"x{i}", prompt(i), 20))
    eng.step()
    assert eng.abort(abort_all=True) == 3
    assert all(c.results[f"x{i}"].finish_reason["type"] == "abort" for i in range(3))
    assert eng.load()["num_running_reqs"] == 0 and eng.load()["num_waiting_reqs"] == 0


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_pause_keeps_or_retracts_and_resume_finishes_identically(ckpts, mode: str) -> None:
    ck, _ = ckpts
    eng, c = fp32(ck), Collector()
    c.add(eng, req("p", prompt(3), 12))
    for _ in range(3):
        eng.step()
    eng.pause(mode)
    n = len(c.tokens["p"])
    assert not eng.step() and len(c.tokens["p"]) == n and eng.is_paused
    load = eng.load()
    assert (load["num_running_reqs"], load["num_waiting_reqs"]) == ((1, 0) if mode == "in_place" else (0, 1))
    eng.resume()
    drain(eng)
    assert c.results["p"].output_ids == alone(ck, req("p", prompt(3), 12)).output_ids


def test_pause_abort_then_new_requests_wait_for_resume(ckpts) -> None:
    ck, _ = ckpts
    eng, c = fp32(ck), Collector()
    c.add(eng, req("q", prompt(1), 12))
    eng.step()
    eng.pause("abort")
    assert c.results["q"].finish_reason["type"] == "abort"
    c.add(eng, req("r", prompt(1), 4))
    assert not eng.step() and "r" not in c.results
    assert not eng.flush_cache()                          # refused while a request waits
    eng.resume()
    drain(eng)
    assert len(c.results["r"].output_ids) == 4
    with pytest.raises(ValueError, match="allowed: in_place, abort, retract"):
        eng.pause("sleep")


def test_engine_thread_with_updates_from_other_threads(ckpts) -> None:
    v0, v7 = ckpts
    eng = fp32(v0)
    stop = threading.Event()
    thread = threading.Thread(target=eng.run_forever, args=(stop,), daemon=True)
    thread.start()
    done: dict[str, RequestResult] = {}
    finished = threading.Event()

    def on_finish(r: RequestResult) -> None:
        done[r.rid] = r
        if len(done) == 3:
            finished.set()

    after_done = threading.Event()
    try:
        for i in range(3):
            eng.add_request(req(f"t{i}", prompt(i), 30), on_finish=on_finish)
        ok, _ = eng.update_weights_from_disk(v7)   # loads on this thread while the engine thread decodes
        assert ok
        assert finished.wait(120)
        # a request sent after the update returned is served by the new weights, whatever the race above did
        eng.add_request(req("after", prompt(0), 5), on_finish=lambda r: (done.__setitem__(r.rid, r), after_done.set()))
        assert after_done.wait(120)
    finally:
        stop.set()
        thread.join(10)
    assert not thread.is_alive()
    assert all(len(done[f"t{i}"].output_ids) == 30 for i in range(3))
    for i in range(3):   # each token carries the version that produced it: 0s, then 7s once the swap landed
        versions = [t.weight_version for t in done[f"t{i}"].tokens]
        assert set(versions) <= {"0", "7"} and versions == sorted(versions, key=int)
    assert eng.weight_version == "7"
    assert done["after"].weight_version == "7" and {t.weight_version for t in done["after"].tokens} == {"7"}


def test_session_cache_is_lru_bounded(ckpts) -> None:
    ck, _ = ckpts
    eng, c = fp32(ck, max_cached_sessions=1), Collector()
    for rid, sess in (("a1", "A"), ("b1", "B")):
        c.add(eng, req(rid, prompt(6), 4, session=sess))
        drain(eng)
    c.add(eng, req("a2", prompt(6) + c.results["a1"].output_ids, 2, session="A"))   # A was evicted by B
    c.add(eng, req("b2", prompt(6) + c.results["b1"].output_ids, 2, session="B"))
    drain(eng)
    assert c.results["a2"].cached_tokens == 0
    assert c.results["b2"].cached_tokens == len(prompt(6)) + 3
