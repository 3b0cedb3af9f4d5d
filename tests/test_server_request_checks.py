"""The sampler server refuses what it must not serve (issue 24, the second probe), over real HTTP on 127.0.0.1
(the embedded engine on a tiny checkpoint, `sampler_helpers`): a lone UTF-16 surrogate in any JSON field is a 400
naming the field (on main a 500 with a reset connection); a web page's cross-origin `text/plain` POST, a
page-like request and a DNS-rebinding Host cannot drive `/update_weights_from_disk` or read anything; local
clients are served as before.
"""

from __future__ import annotations

import json

import httpx
import pytest
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
    from mixfleet.runner.sampler.browser_guard import check_browser_request

    h = httpx.Headers
    assert check_browser_request("GET", h({"host": "node-7.cluster:30000"}), "10.0.0.5") is None
    assert check_browser_request("GET", h({"host": "node-7.cluster:30000"}), "127.0.0.1")[0] == 403
    refused = check_browser_request("POST", h({"host": "10.0.0.5:30000", "origin": "http://evil.example"}),
                                    "10.0.0.5")
    assert refused is not None and refused[0] == 403
    assert check_browser_request("POST", h({"host": "[::1]:30000"}), "::1") is None
