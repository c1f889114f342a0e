"""Sandbox queries (dsec.shared.wire.console.SandboxQuery): the filter and order an edge applies
to its own sandboxes, and the merge of the edges' pages into the fleet's page. One
definition for both, so a page the apiserver merges is the page one edge would give."""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

from dsec.shared.wire.console import SandboxPage, SandboxQuery
from dsec.shared.wire.iam import project_of_sandbox, within
from dsec.shared.wire.models import SandboxInfo

TOP_JOBS = 50


def matches(info: SandboxInfo, q: SandboxQuery) -> bool:
    if q.state and info.state not in q.state:
        return False
    if q.backend and info.backend not in q.backend:
        return False
    if q.job is not None and info.job != q.job:
        return False
    if q.edge is not None and info.edge != q.edge:
        return False
    if q.labels and any(info.labels.get(k) != v for k, v in q.labels.items()):
        return False
    if q.project is not None or q.scope is not None:
        project = project_of_sandbox(info)
        if q.project is not None and project != q.project:
            return False
        if q.scope is not None and not (project == q.scope or (
                q.scope_subtree and project is not None and within(project, q.scope))):
            return False
    if q.q:
        needle = q.q.lower()
        hay = itertools.chain((info.sandbox_id, info.image, info.job or "", info.edge, info.state),
                              (f"{k}={v}" for k, v in info.labels.items()))
        if not any(needle in h.lower() for h in hay):
            return False
    return True


def needs_usage(q: SandboxQuery) -> bool:
    return q.sort.lstrip("-") in ("cpu", "memory")


def sort_key(q: SandboxQuery) -> Callable[[SandboxInfo], Any]:
    """The key of the query's field, ties broken by id: one total order that every edge and
    the merge agree on (descending is that order reversed, see ``descending``)."""
    field = q.sort.lstrip("-")

    def value(i: SandboxInfo) -> float:
        if field == "created":
            return i.created_at
        if field == "last_active":
            return i.last_active_at
        use = i.usage
        if use is None:
            return 0.0
        return use.cpu_s if field == "cpu" else float(use.memory_bytes)

    return lambda i: (value(i), i.sandbox_id)


def descending(q: SandboxQuery) -> bool:
    return q.sort.startswith("-")


def ordered(items: list[SandboxInfo], q: SandboxQuery) -> list[SandboxInfo]:
    """All of ``items`` in the query's order."""
    return sorted(items, key=sort_key(q), reverse=descending(q))


def counts(items: Iterable[SandboxInfo]) -> tuple[dict[str, int], dict[str, int], dict[str, dict[str, int]]]:
    states: Counter[str] = Counter()
    backends: Counter[str] = Counter()
    jobs: dict[str, Counter[str]] = {}
    for i in items:
        states[i.state] += 1
        backends[i.backend] += 1
        if i.job:
            jobs.setdefault(i.job, Counter())[i.state] += 1
    return dict(states), dict(backends), _top_jobs(jobs)


def _top_jobs(jobs: dict[str, Counter[str]]) -> dict[str, dict[str, int]]:
    top = sorted(jobs.items(), key=lambda kv: (-sum(kv[1].values()), kv[0]))[:TOP_JOBS]
    return {name: dict(c) for name, c in top}


def answer(items: list[SandboxInfo], q: SandboxQuery) -> SandboxPage:
    """One edge's page: its matching items (usage filled by the caller where needed),
    the first ``offset + limit`` of them in order (the merge needs every edge's prefix),
    and the counts of all that match."""
    hits = [i for i in items if matches(i, q)]
    states, backends, jobs = counts(hits)
    first = heapq.nlargest if descending(q) else heapq.nsmallest
    window = first(q.offset + q.limit, hits, key=sort_key(q)) if q.offset + q.limit else []
    return SandboxPage(total=len(hits), offset=0, limit=q.offset + q.limit, items=window, states=states,
                       backends=backends, jobs=jobs)


def merge(pages: list[SandboxPage], q: SandboxQuery, unreachable: list[str]) -> SandboxPage:
    """The fleet's page from the edges' answers."""
    merged = heapq.merge(*(p.items for p in pages), key=sort_key(q), reverse=descending(q))
    items = list(itertools.islice(merged, q.offset, q.offset + q.limit))
    states: Counter[str] = Counter()
    backends: Counter[str] = Counter()
    jobs: dict[str, Counter[str]] = {}
    for p in pages:
        states.update(p.states)
        backends.update(p.backends)
        for name, by_state in p.jobs.items():
            jobs.setdefault(name, Counter()).update(by_state)
    return SandboxPage(total=sum(p.total for p in pages), offset=q.offset, limit=q.limit, items=items,
                       states=dict(states), backends=dict(backends), jobs=_top_jobs(jobs), unreachable=unreachable)
