"""Which requests a web page made, so the sampler server refuses them (`check_browser_request`).

A web page must not drive a local sampler, so a server bound to a loopback address answers only a loopback Host
(localhost, *.localhost, 127.x.x.x, [::1]: a DNS-rebinding name is refused), every request that says it comes
from another origin (an `Origin` that is not the request's own, `Sec-Fetch-Site: cross-site` / `same-site`) is
refused with 403, and a POST / PUT body must be JSON (`Content-Type` application/json, or none): the content
types a page may send without a CORS preflight (text/plain, forms) get a 400, as real SGLang's FastAPI handlers
refuse non-JSON bodies. This holds with or without an API key. The server (runner/sampler/server.py) applies
the check to every request in its `BrowserGuard` middleware; here are only the pure checks (no I/O).
"""

from __future__ import annotations

import ipaddress
from typing import Any

CROSS_SITE_FETCH = ("cross-site", "same-site")  # Sec-Fetch-Site values of a request from another page's origin
JSON_CONTENT_TYPES = ("application/json",)      # and application/*+json; no Content-Type at all is fine too


def is_loopback_host(host: str) -> bool:
    """A host name or address only this machine reaches: localhost, *.localhost (RFC 6761), 127.0.0.0/8, ::1."""
    name = host.strip().lower().rstrip(".")
    if name.startswith("[") and name.endswith("]"):
        name = name[1:-1]
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _split_host(value: str) -> str:
    """The host part of a Host header value ("127.0.0.1:30000", "[::1]:30000", "localhost")."""
    value = value.strip()
    if value.startswith("["):
        return value[: value.find("]") + 1] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def check_browser_request(method: str, headers: Any, bind_host: str) -> tuple[int, str] | None:
    """(status, message) when a request must be refused as one a web page made (see the module doc), else None.

    `headers`: the request's headers (case-insensitive mapping); `bind_host`: the address the server is bound to
    (a loopback one turns the Host check on)."""
    host = headers.get("host")
    if host is not None and is_loopback_host(bind_host) and not is_loopback_host(_split_host(host)):
        return 403, (f"Host header {host[:100]!r} is not a loopback name: this sampler is bound to {bind_host} and "
                     "answers Host localhost, *.localhost, 127.x.x.x or [::1] only (a DNS-rebinding guard); start it "
                     "with --host to serve it under another name")
    origin = headers.get("origin")
    if origin is not None:
        own = {f"{scheme}://{host}".lower() for scheme in ("http", "https")} if host else set()
        if origin.strip().lower().rstrip("/") not in own:
            return 403, (f"Origin {origin[:100]!r} is not this sampler's own origin: requests from web pages of "
                         "another origin are refused (a sampler has no browser clients)")
    fetch_site = headers.get("sec-fetch-site")
    if fetch_site is not None and fetch_site.strip().lower() in CROSS_SITE_FETCH:
        return 403, (f"Sec-Fetch-Site = {fetch_site[:40]!r}: requests from web pages of another site are refused "
                     "(allowed: same-origin, none, or no such header)")
    if method in ("POST", "PUT"):
        ctype = headers.get("content-type")
        if ctype is not None:
            media = ctype.split(";", 1)[0].strip().lower()
            if not (media in JSON_CONTENT_TYPES or (media.startswith("application/") and media.endswith("+json"))):
                return 400, (f"Content-Type = {ctype[:80]!r}: a {method} body must be JSON; allowed: "
                             "application/json (or no Content-Type), e.g. curl -H 'Content-Type: application/json'")
    return None
