"""The SDK's HTTP core under every resource: where the apiserver is (one URL or several
replicas, which one answers now), a response, and how an answer or its absence becomes a
typed error naming the call (:class:`dsec.shared.errors.DsecError` and its kin). The client
(:mod:`dsec.client.sdk.client`) and each resource handle (batches, jobs, ...) import it; it
imports none of them."""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp

from dsec.shared.errors import ERRORS_BY_CODE, DeadlineExceeded, DsecError, EdgeUnavailable, RateLimited

DEFAULT_URL = "http://127.0.0.1:7777"
_ID = re.compile(r"/(sandboxes|jobs|batches|rollouts|layers|nodes|projects|tokens)/[^/]+")


def _route_of(path: str) -> str:
    """A path with its ids taken out: a span's name is the same for every sandbox."""
    return _ID.sub(lambda m: f"/{m.group(1)}/{{id}}", path)
# a replica that failed goes to the back of the queue this long: requests in the meantime
# go to the others first instead of paying for its failure again, yet one blip never
# takes it out of service for long
REPLICA_BACKOFF_S = 5.0
# with other replicas to go to, a host that swallows SYNs should cost seconds, not the
# request's whole timeout (two SYNs: the first retransmit comes after 1 s)
REPLICA_CONNECT_TIMEOUT_S = 3.0
_SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
# the connection never got to carry the request: connect refused, timed out, DNS, TLS
_NEVER_SENT = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)


def default_url() -> str:
    return os.environ.get("DSEC_URL", DEFAULT_URL)


def _parse_urls(url: str | Sequence[str]) -> tuple[str, ...]:
    """The apiserver URLs of ``"http://a:7777,http://b:7777"`` or a list of them, in order."""
    items = url.split(",") if isinstance(url, str) else url
    urls = tuple(dict.fromkeys(u.strip().rstrip("/") for u in items if u.strip()))
    if not urls:
        raise ValueError("no apiserver URL given")
    for u in urls:
        if not u.startswith(("http://", "https://")):
            raise ValueError(f"apiserver URL {u!r} is not http://HOST:PORT or https://...")
    return urls


def default_token() -> str | None:
    if tok := os.environ.get("DSEC_TOKEN"):
        return tok
    path = os.path.join(os.environ.get("DSEC_DATA_DIR", "/var/lib/dsec"), "token")
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


@dataclass
class Response:
    """A buffered HTTP response."""

    status_code: int
    content: bytes
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", errors="replace")

    def json(self) -> Any:
        return json.loads(self.content)


def _call_of(method: str, path: str) -> tuple[str | None, str]:
    """(sandbox id, operation) of a request path: ``POST /v1/sandboxes/ID/stop`` is
    (ID, "stop"); ``POST /v1/sandboxes`` is (None, "create")."""
    parts = [p for p in path.split("?")[0].split("/") if p]
    if len(parts) >= 2 and parts[1] == "sandboxes":
        if len(parts) == 2:
            return None, "create" if method == "POST" else "list"
        op = "/".join(parts[3:]) or {"GET": "get", "DELETE": "stop"}.get(method, method.lower())
        return parts[2], op
    return None, f"{method} {'/'.join(parts[1:]) or '/'}"


def _transport_error(e: BaseException, url: str, method: str, path: str, timeout: float | None) -> DsecError:
    """What the SDK raises when no answer came: says which call, on which sandbox, and why."""
    sid, op, what = _what(method, path)
    if isinstance(e, TimeoutError):
        return DeadlineExceeded(f"{what} got no answer from dsec at {url} within "
                                f"{timeout if timeout is not None else 'the session'}s timeout "
                                "(the request was sent; the platform may still finish it)",
                                sandbox_id=sid, operation=op)
    return EdgeUnavailable(f"{what}: cannot reach dsec at {url}: {e or type(e).__name__}",
                           sandbox_id=sid, operation=op)


def _idempotent(method: str, path: str) -> bool:
    """Whether a request that may have reached one replica may be sent again to another:
    reads, and stopping one sandbox (a stopped sandbox's record answers a second stop for an
    hour, and a late duplicate stop can undo no later request). Everything else (create,
    exec without a key, files, fork, pause, a job-wide stop whose selection could take in
    sandboxes made since, ...) is never repeated: its outcome is unknown."""
    if method in _SAFE_METHODS:
        return True
    return method == "DELETE" and _call_of(method, path)[1] == "stop"


def _keyed_exec(method: str, path: str, body: Any) -> bool:
    """An exec with a command-log key may be sent again: the edge runs it once and answers
    a repeat with its record (or waits for the run under way), whichever replica relays it."""
    return method == "POST" and path.endswith("/exec") and isinstance(body, dict) and bool(body.get("key"))


def _what(method: str, path: str) -> tuple[str | None, str, str]:
    """(sandbox id, operation, how an error message names the call)."""
    sid, op = _call_of(method, path)
    return sid, op, op + (f" of sandbox {sid}" if sid else "")


def _reason(e: BaseException) -> str:
    """Why a replica failed, short: "connection refused" rather than aiohttp's paragraph."""
    if isinstance(e, aiohttp.ConnectionTimeoutError):
        return "connect timed out"
    if isinstance(e, aiohttp.ClientConnectorError) and e.os_error.errno:
        return os.strerror(e.os_error.errno).lower()
    return str(e) or type(e).__name__


def _is_dsec_error(content: bytes) -> bool:
    """Whether a body is dsec's own error: a 503 carrying one (an edge is down) is an answer
    every replica would give, a bare one is a proxy's word that this replica is gone."""
    try:
        body = json.loads(content)
    except ValueError:
        return False
    return isinstance(body, dict) and "error" in body


def _raise_for(resp: Response, method: str = "", path: str = "") -> None:
    if resp.status_code < 400:
        return
    sid, op = _call_of(method, path) if path else (None, None)
    try:
        body = resp.json()
        cls = ERRORS_BY_CODE.get(body.get("error", ""), DsecError)
    except (ValueError, AttributeError):
        err = DsecError(f"HTTP {resp.status_code}: {resp.text[:500]}", sandbox_id=sid, operation=op)
        err.status = resp.status_code
        raise err from None
    err = cls(body.get("message", resp.text), field=body.get("field"), sandbox_id=sid, operation=op)
    if isinstance(err, RateLimited) and isinstance(body.get("retry_after"), (int, float)):
        err.retry_after = float(body["retry_after"])
    if cls is DsecError:  # a code this SDK does not know: the status still says whose failure it is
        err.status = resp.status_code
    raise err


def _filters(job: str | None, labels: dict[str, str] | None) -> list[tuple[str, str]]:
    """Query parameters selecting sandboxes by job and labels."""
    params = [("label", f"{k}={v}") for k, v in (labels or {}).items()]
    if job:
        params.append(("job", job))
    return params


class _Replicas:
    """The apiserver replicas of a client given several URLs: which one is in use (the
    first, then whichever answered last) and which are backing off after a failure."""

    def __init__(self, urls: tuple[str, ...]) -> None:
        self.urls = urls
        self.current = 0
        self.down_until = [0.0] * len(urls)

    def order(self) -> list[int]:
        """Each replica once, for one request: the current one and those after it, the
        ones backing off last (still tried: with every replica failing lately, the
        request is better sent than refused unsent)."""
        now, n = time.monotonic(), len(self.urls)
        return sorted(((self.current + k) % n for k in range(n)), key=lambda i: self.down_until[i] > now)

    def failed(self, i: int) -> None:
        self.down_until[i] = time.monotonic() + REPLICA_BACKOFF_S

    def answered(self, i: int) -> None:
        self.current = i
        self.down_until[i] = 0.0


class Api(Protocol):
    """What a resource handle (a sandbox, a batch, a job, ...) asks of the client: its
    requests, and the replica in use (``dsec.client.sdk.client.AsyncClient`` is one)."""

    @property
    def url(self) -> str: ...

    async def _request(self, method: str, path: str, *, params: Any = None, json: Any = None,
                       content: bytes | str | None = None, headers: dict[str, str] | None = None,
                       timeout: float | None = None, check: bool = True) -> Response: ...

    async def _open(self, method: str, path: str, kw: dict[str, Any], timeout: float) -> aiohttp.ClientResponse: ...

    async def _json(self, method: str, path: str, **kw: Any) -> Any: ...
