"""The console's sandbox query and its sessions, as pure functions: every edge answers a
query for its own sandboxes and the apiserver merges the answers; on a 10,000-sandbox
fleet split over edges, each merged page must be exactly the page of one global sort,
with exact counts, and only the caller's projects. Sessions: a cookie verifies only with
its signature, until it expires, and only while its token lives. (The records are built
here; the same code runs against real edges in tests/test_console.py and
tests/test_cluster.py.)"""

from __future__ import annotations

import random
from collections import Counter

import pytest

from dsec.control.console import session
from dsec.control.iam.tokens import ADMIN, Principal
from dsec.shared import query
from dsec.shared.wire.console import SandboxQuery
from dsec.shared.wire.models import SandboxInfo, SandboxUsage

STATES = ["running", "running", "running", "paused", "stopped", "failed", "creating"]


def fleet(n: int, edges: int, seed: int = 7) -> dict[str, list[SandboxInfo]]:
    rnd = random.Random(seed)
    out: dict[str, list[SandboxInfo]] = {f"e{k}": [] for k in range(edges)}
    for i in range(n):
        edge = f"e{rnd.randrange(edges)}"
        project = rnd.choice(["default", "team-a", "team-a/sub", "team-b"])
        labels = {"dsec.project": project} if project != "default" else {}
        if i % 10 == 0:
            labels["kind"] = "eval"
        out[edge].append(SandboxInfo(
            sandbox_id=f"{edge}-{i:08d}", edge=edge, backend=rnd.choice(["container", "container", "microvm"]),
            state=rnd.choice(STATES), image=rnd.choice(["base/debian:12", "base/busybox"]), layers=[],
            created_at=1000.0 + rnd.randrange(5000), last_active_at=2000.0 + rnd.random() * 1000,
            labels=labels, job=rnd.choice([None, "grpo", "eval-1", "eval-2"]), memory_limit_mb=512,
            cpu_cores_limit=1.0, usage=SandboxUsage(cpu_s=rnd.random() * 100, memory_bytes=rnd.randrange(1 << 30))))
    return out


def run(by_edge: dict[str, list[SandboxInfo]], q: SandboxQuery) -> tuple[list[SandboxInfo], int, dict[str, int]]:
    page = query.merge([query.answer(items, q) for items in by_edge.values()], q, [])
    return page.items, page.total, page.states


def expected(by_edge: dict[str, list[SandboxInfo]], q: SandboxQuery) -> list[SandboxInfo]:
    return query.ordered([i for items in by_edge.values() for i in items if query.matches(i, q)], q)


@pytest.mark.parametrize("sort", ["-created", "created", "-last_active", "-cpu", "memory"])
def test_pages_of_a_10k_fleet_are_the_global_order(sort: str) -> None:
    by_edge = fleet(10_000, 5)
    whole = expected(by_edge, SandboxQuery(sort=sort, limit=0))  # type: ignore[arg-type]
    assert len(whole) == 10_000
    seen: list[str] = []
    for offset in (0, 50, 4_950, 9_950):
        q = SandboxQuery(sort=sort, offset=offset, limit=50)  # type: ignore[arg-type]
        items, total, _ = run(by_edge, q)
        assert total == 10_000
        assert [i.sandbox_id for i in items] == [i.sandbox_id for i in whole[offset:offset + 50]]
        seen += [i.sandbox_id for i in items]
    assert len(set(seen)) == len(seen)  # no sandbox on two pages
    key = sort.lstrip("-")
    first = whole[0]
    if key == "created":
        best = (max if sort.startswith("-") else min)(i.created_at for i in whole)
        assert first.created_at == best


def test_filters_combine_and_counts_cover_every_match() -> None:
    by_edge = fleet(10_000, 4)
    q = SandboxQuery(state=["running", "paused"], backend=["container"], job="grpo", labels={"kind": "eval"},
                     limit=20)
    items, total, states = run(by_edge, q)
    want = expected(by_edge, q)
    assert total == len(want) and [i.sandbox_id for i in items] == [i.sandbox_id for i in want[:20]]
    assert states == dict(Counter(i.state for i in want))
    assert all(i.state in ("running", "paused") and i.backend == "container" and i.job == "grpo"
               and i.labels.get("kind") == "eval" for i in items)
    # search: a substring of the id, image, job or a label
    items, total, _ = run(by_edge, SandboxQuery(q="E2-0000", limit=500))
    assert total == len(expected(by_edge, SandboxQuery(q="e2-0000", limit=0))) > 0
    assert all("e2-0000" in i.sandbox_id for i in items)


def test_a_project_scope_sees_its_project_and_an_admin_its_subtree() -> None:
    by_edge = fleet(4_000, 3)
    _, total, _ = run(by_edge, SandboxQuery(scope="team-a", limit=0))
    _, subtree, _ = run(by_edge, SandboxQuery(scope="team-a", scope_subtree=True, limit=0))
    all_items = [i for items in by_edge.values() for i in items]
    assert total == sum(i.labels.get("dsec.project") == "team-a" for i in all_items)
    assert subtree == sum(i.labels.get("dsec.project", "").startswith("team-a") for i in all_items) > total
    # a filter cannot widen the scope: another project inside a scoped query finds nothing
    _, other, _ = run(by_edge, SandboxQuery(scope="team-a", project="team-b", limit=0))
    assert other == 0
    # the platform's own FnCall containers are no project's: only an unscoped (cluster admin) query sees them
    pool = SandboxInfo(sandbox_id="e0-pool", edge="e0", backend="container", state="running", image="x",
                       layers=[], created_at=1, last_active_at=1, labels={"dsec-role": "fncall"},
                       memory_limit_mb=1, cpu_cores_limit=1)
    assert not query.matches(pool, SandboxQuery(scope="default"))
    assert query.matches(pool, SandboxQuery())


def test_an_edge_answers_only_the_window_the_merge_needs() -> None:
    by_edge = fleet(3_000, 3)
    q = SandboxQuery(offset=100, limit=50)
    part = query.answer(by_edge["e0"], q)
    assert len(part.items) == 150 and part.total == len(by_edge["e0"])
    counts_only = query.answer(by_edge["e0"], SandboxQuery(limit=0))
    assert counts_only.items == [] and sum(counts_only.states.values()) == len(by_edge["e0"])
    # jobs: the 50 largest, each by state
    assert set(counts_only.jobs) == {"grpo", "eval-1", "eval-2"}
    assert sum(sum(c.values()) for c in counts_only.jobs.values()) == sum(1 for i in by_edge["e0"] if i.job)


def test_a_query_refuses_what_it_cannot_answer() -> None:
    from pydantic import ValidationError
    for bad in ({"limit": 501}, {"offset": 20_001}, {"sort": "sideways"}, {"q": "x" * 201}, {"extra": 1}):
        with pytest.raises(ValidationError):
            SandboxQuery(**bad)  # type: ignore[arg-type]


class Keys:
    def __init__(self) -> None:
        self.live = {"admin": ADMIN, "t1": Principal("t1", "team-a", "runner", None)}

    def derive(self, purpose: str, value: str) -> str:
        import hashlib
        import hmac
        return hmac.new(b"secret", f"{purpose}\0{value}".encode(), hashlib.sha256).hexdigest()[:40]

    async def principal(self, token_id: str) -> Principal | None:
        return self.live.get(token_id)


async def test_sessions_verify_by_signature_expiry_and_a_live_token() -> None:
    keys = Keys()
    value, s = session.issue(keys, keys.live["t1"], now=1000.0)
    assert s.expires_at == 1000 + session.SESSION_S and "t1" in value
    assert session.issue(keys, keys.live["t1"], now=1000.0)[1].nonce != s.nonce  # each login its own session
    assert session.parse(keys, value, now=1001.0) == s
    assert session.parse(keys, value, now=s.expires_at + 1) is None  # expired
    tampered = value.replace("t1", "admin")
    assert session.parse(keys, tampered, now=1001.0) is None  # the signature covers the token id
    longer = value.replace(str(s.expires_at), str(s.expires_at + 10**6))
    assert session.parse(keys, longer, now=1001.0) is None  # and the expiry
    # a session never outlives its token
    short = Principal("t1", "team-a", "runner", expires_at=1500.0)
    _, s2 = session.issue(keys, short, now=1000.0)
    assert s2.expires_at == 1500
    # a revoked token ends its sessions
    fresh, _ = session.issue(keys, keys.live["t1"])
    assert await session.principal_of(keys, None, f"a=b; {session.COOKIE}={fresh}".encode()) == keys.live["t1"]
    # two session cookies (one planted by whatever could set a cookie) are never guessed between
    other, _ = session.issue(keys, keys.live["admin"])
    assert await session.principal_of(keys, None, f"{session.COOKIE}={other}; {session.COOKIE}={fresh}".encode()) \
        is None
    # malformed values are no session, never an error
    for bad in ("v2.admin.1.9999999999.abcdefghijklmnop.\u00e9", "v2..1.2.x.y", "v1.admin.9999999999.deadbeef",
                fresh + "0", fresh.replace("v2.", "v3."), "v2.t1.1.99999999999999.abcdefghijklmnop." + "0" * 40):
        assert session.parse(keys, bad) is None, bad
    del keys.live["t1"]
    assert await session.principal_of(keys, None, f"{session.COOKIE}={fresh}".encode()) is None
    assert session.without_session(f"a=1; {session.COOKIE}={fresh}; b=2") == "a=1; b=2"
