"""Fleet health end to end (docs/fault-tolerance.md): three real edge daemons over a
MooseFS store behind an apiserver (tests/conftest.py's Cluster), one injected fault at a
time: slow creates (a failpoint's sleep), failing shared-store reads (the ``store.read``
failpoint), a disk filled for real, an edge that stops answering (SIGSTOP). Each time the
sick edge goes suspect then cordoned with evidence naming the signal, the others stay ok,
no new sandbox lands on it, and the events say so; then an operator lifts the cordon.
Cordons by hand through the SDK and the CLI, and bad input. bench/health.py reuses this
fleet at the detector's defaults.
"""

from __future__ import annotations

import asyncio
import errno
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

import dsec
from dsec.node.edge.remote.client import remote_edge
from dsec.node.storage.moosefs import MooseFS
from tests.conftest import SECRET, TOKEN, Cluster

# ---- end to end: three edge daemons, one apiserver ------------------------------------
# Shorter than the defaults (measured at the defaults: bench/health.py) to fit the test
# budget: cordon after 3 s suspect instead of 10, a latency verdict from 3 creates instead
# of 5 (three edges each get a few in seconds), and 5 rounds without an answer (an edge the
# machine shared with other tests may stall a daemon for a round or two).
E2E_HEALTH = "cordon_after_s=3,min_samples=3,unreachable_rounds=5,clear_rounds=2"
NAMES = ("n1", "n2", "n3")
VOLUME_GB = 1  # each edge's sandbox volume: small, so filling it for real is cheap


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    yield from run_fleet(str(tmp_path_factory.mktemp("health")), {"DSEC_HEALTH": E2E_HEALTH})


def run_fleet(root: str, api_env: dict[str, str]) -> Iterator[Cluster]:
    """Three edges over a MooseFS store, each with a failpoint file (:func:`inject`) and a
    small sandbox volume, behind an apiserver with ``api_env``; everything stopped after."""
    fs = MooseFS(os.path.join(root, "moosefs"))  # the shared store every edge reads on demand, as nodes do
    fs.start()
    try:
        store = os.path.join(fs.mount, "dsec")
        os.makedirs(store)
        os.makedirs(os.path.join(root, "fleet"))
        args = {n: ["--sandbox-volume-gb", str(VOLUME_GB)] for n in NAMES}
        c = Cluster(os.path.join(root, "fleet"), NAMES, store, args)
        c.api.env = api_env
        for name, e in c.edges.items():  # faults are turned on and off by writing this file
            e.env = {"DSEC_FAILPOINTS": f"@{_failpoints(c, name)}"}
        try:
            c.start()
            yield c
        finally:
            stop_all_and_volumes(c)
    finally:
        fs.stop()


def stop_all_and_volumes(c: Cluster) -> None:
    from tests.conftest import stop_all

    for e in c.edges.values():  # a stopped (SIGSTOP) edge cannot be stopped otherwise
        if e.proc is not None:
            os.kill(e.proc.pid, signal.SIGCONT)
    stop_all(c)


def fill_disk(path: str) -> None:
    """Grow ``path`` by real blocks until its filesystem has 8 MiB left, as far as it gives
    them: btrfs returns the space of deleted subvolumes late, so what it says is free may
    not be yet, and space may come back after (call again to top it up)."""
    st = os.statvfs(os.path.dirname(path))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        size = st.f_bavail * st.f_frsize - (8 << 20)
        while size > 0:
            try:
                os.posix_fallocate(fd, os.fstat(fd).st_size, size)
                return
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
                size -= 32 << 20
    finally:
        os.close(fd)


def _edge_of(sid: str) -> str:
    return sid.rsplit("-", 1)[0]


async def _health(c: dsec.AsyncClient) -> dict[str, str]:
    return {n.edge: n.health for n in await c.nodes()}


async def _until_health(c: dsec.AsyncClient, edge: str, want: str, timeout: float = 60.0,
                        drive: object = None) -> list[str]:
    """Poll until ``edge``'s health is ``want``; returns every health seen on the way."""
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        h = (await c.nodes.get(edge)).health
        if not seen or seen[-1] != h:
            seen.append(h)
        if h == want:
            return seen
        if drive is not None:
            await drive()  # type: ignore[operator]
        await asyncio.sleep(0.3)
    raise AssertionError(f"{edge} never went {want}: {seen}; {await _health(c)}")


def _failpoints(c: Cluster, name: str) -> str:
    return os.path.join(c.root, f"{name}.failpoints")


def inject(c: Cluster, name: str, failpoints: str | None) -> None:
    """Turn faults on (``failpoints``) or off at edge ``name`` while it runs."""
    path = _failpoints(c, name)
    if failpoints is None:
        if os.path.exists(path):
            os.unlink(path)
        return
    with open(path + ".tmp", "w") as f:
        f.write(failpoints)
    os.replace(path + ".tmp", path)


async def _check_cordoned(c: dsec.AsyncClient, edge: str, signal_name: str, made: list[dsec.AsyncSandbox]) -> None:
    """``edge`` went suspect then cordoned on ``signal_name``, alone; new sandboxes avoid it;
    the events say so; an operator's uncordon lifts it."""
    node = await c.nodes.get(edge)
    assert node.health == "cordoned" and node.cordoned and node.cordoned_by == "detector"
    assert signal_name in [e.signal for e in node.evidence], node.evidence
    others = await _health(c)
    assert [others[n] for n in NAMES if n != edge] == ["ok", "ok"], others
    fresh = [await c.run_container(dsec.ContainerArgs(image="base/busybox", job="health")) for _ in range(4)]
    made += fresh
    assert edge not in {_edge_of(s.sandbox_id) for s in fresh}
    events = await c.nodes.events(edge)
    kinds = [e.kind for e in events if e.actor == "detector"]
    assert kinds[-2:] == ["suspect", "cordoned"], kinds
    assert signal_name in {x["signal"] for x in events[-1].detail["evidence"]}


async def _uncordon(c: dsec.AsyncClient, edge: str) -> None:
    node = await c.nodes.uncordon(edge, "fault cleared by the test")
    assert node.health == "ok" and not node.cordoned
    last = (await c.nodes.events(edge))[-1]
    assert last.kind == "uncordoned" and last.reason == "fault cleared by the test" and last.actor != "detector"


async def _create_until(c: dsec.AsyncClient, made: list[dsec.AsyncSandbox], edge: str, until: object,
                        limit: int = 30) -> int:
    """Create sandboxes (one at a time, kept) until ``until()``; failures are counted, not raised."""
    failed = 0
    for _ in range(limit):
        if await until():  # type: ignore[operator]
            break
        try:
            made.append(await c.run_container(dsec.ContainerArgs(image="base/busybox", job="health")))
        except dsec.DsecError:
            failed += 1
    return failed


async def _stop(c: dsec.AsyncClient, made: list[dsec.AsyncSandbox]) -> None:
    await c.stop_many(job="health")
    made.clear()


async def test_slow_creates_get_an_edge_cordoned(fleet: Cluster) -> None:
    inject(fleet, "n3", "create.attached=sleep:2")
    made: list[dsec.AsyncSandbox] = []
    async with dsec.AsyncClient(url=fleet.url, token=TOKEN) as c:
        try:
            async def flagged() -> bool:
                return (await c.nodes.get("n3")).health != "ok"
            await _create_until(c, made, "n3", flagged)
            seen = await _until_health(c, "n3", "cordoned")
            assert seen[0] == "suspect" or "suspect" in seen, seen
            await _check_cordoned(c, "n3", "create_latency", made)
        finally:
            await _stop(c, made)
            inject(fleet, "n3", None)
            await _uncordon(c, "n3")


async def test_failing_store_reads_get_an_edge_cordoned(fleet: Cluster) -> None:
    inject(fleet, "n2", "store.read=error")
    made: list[dsec.AsyncSandbox] = []
    async with dsec.AsyncClient(url=fleet.url, token=TOKEN) as c:
        try:
            async def flagged() -> bool:
                return (await c.nodes.get("n2")).health != "ok"
            await _create_until(c, made, "n2", flagged)
            seen = await _until_health(c, "n2", "cordoned")
            assert "suspect" in seen or seen == ["cordoned"], seen
            await _check_cordoned(c, "n2", "store_errors", made)
            assert (await c.nodes.get("n2")).signals.store_errors >= 3  # type: ignore[union-attr]
        finally:
            await _stop(c, made)
            inject(fleet, "n2", None)
            await _uncordon(c, "n2")


async def test_a_full_disk_gets_an_edge_cordoned(fleet: Cluster) -> None:
    volume = os.path.join(fleet.root, "n1", "edges", "n1", "volume")
    assert os.path.ismount(volume)
    fill = os.path.join(volume, "health-test-fill")
    made: list[dsec.AsyncSandbox] = []
    fill_disk(fill)

    async def top_up() -> None:
        fill_disk(fill)
    async with dsec.AsyncClient(url=fleet.url, token=TOKEN) as c:
        try:
            seen = await _until_health(c, "n1", "cordoned", drive=top_up)
            assert seen[0] == "suspect" or "suspect" in seen, seen
            await _check_cordoned(c, "n1", "disk", made)
            assert (await c.nodes.get("n1")).evidence[0].value >= 0.95
        finally:
            os.unlink(fill)
            os.sync()  # btrfs gives the blocks back at its next commit
            await _stop(c, made)
            for _ in range(100):  # the edge reports the space back before the cordon is lifted
                sig = (await c.nodes.get("n1")).signals
                if sig is not None and sig.disk_used_bytes < 0.9 * sig.disk_total_bytes:
                    break
                await asyncio.sleep(0.2)
            await _uncordon(c, "n1")


async def test_an_edge_that_stops_answering_gets_cordoned(fleet: Cluster) -> None:
    proc = fleet.edges["n3"].proc
    assert proc is not None
    made: list[dsec.AsyncSandbox] = []
    os.kill(proc.pid, signal.SIGSTOP)
    async with dsec.AsyncClient(url=fleet.url, token=TOKEN) as c:
        try:
            seen = await _until_health(c, "n3", "cordoned")
            assert "suspect" in seen, seen
            assert (await c.nodes.get("n3")).state == "unreachable"
            os.kill(proc.pid, signal.SIGCONT)
            # back, it is still cordoned (until an operator says otherwise), and its
            # daemon was told so again: it refuses creates itself
            await _until_health(c, "n3", "cordoned")
            for _ in range(50):
                if (await c.nodes.get("n3")).state == "up":
                    break
                await asyncio.sleep(0.2)
            edge = remote_edge("n3", fleet.edges["n3"].url, SECRET)
            try:
                for _ in range(50):  # the next round tells the daemon itself
                    if (await edge.stats()).cordoned:
                        break
                    await asyncio.sleep(0.2)
                assert (await edge.stats()).cordoned
                with pytest.raises(dsec.AdmissionRejected, match="cordoned"):
                    await edge.create(dsec.ContainerArgs(image="base/busybox"))
            finally:
                await edge.close()
            await _check_cordoned(c, "n3", "unreachable", made)
        finally:
            os.kill(proc.pid, signal.SIGCONT)
            await _stop(c, made)
            await _uncordon(c, "n3")


async def test_a_cordon_by_hand_holds_until_lifted_by_hand(fleet: Cluster) -> None:
    made: list[dsec.AsyncSandbox] = []
    async with dsec.AsyncClient(url=fleet.url, token=TOKEN) as c:
        try:
            node = await c.nodes.cordon("n2", "kernel upgrade")
            assert node.health == "cordoned" and node.cordoned_by not in ("", "detector")
            assert node.health_reason == "kernel upgrade"
            await asyncio.sleep(3)  # rounds of a detector that finds nothing wrong with n2
            assert (await c.nodes.get("n2")).health == "cordoned"
            made += [await c.run_container(dsec.ContainerArgs(image="base/busybox", job="health")) for _ in range(4)]
            assert "n2" not in {_edge_of(s.sandbox_id) for s in made}
            ev = (await c.nodes.events("n2", kind="cordoned"))[-1]
            assert ev.reason == "kernel upgrade" and ev.actor == node.cordoned_by
        finally:
            await _stop(c, made)
            await _uncordon(c, "n2")
        assert (await c.nodes.get("n2")).health == "ok"


def test_cli_nodes_cordon_uncordon_events(fleet: Cluster) -> None:
    env = {**os.environ, "DSEC_URL": fleet.url, "DSEC_TOKEN": TOKEN, "COLUMNS": "200"}
    cli = [sys.executable, "-m", "dsec.client.cli.main"]

    def run(*a: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*cli, *a], capture_output=True, text=True, timeout=60, env=env)
    out = run("node", "cordon", "n1", "--reason", "disk swap")
    assert out.returncode == 0 and "cordoned" in out.stdout, out.stdout + out.stderr
    table = run("nodes")
    assert table.returncode == 0, table.stderr
    line = next(x for x in table.stdout.splitlines() if " n1 " in x)
    assert "cordoned" in line and "disk swap" in line, table.stdout
    events = run("node", "events", "--edge", "n1")
    assert "disk swap" in events.stdout and "cordoned" in events.stdout, events.stdout
    out = run("node", "uncordon", "n1")
    assert out.returncode == 0 and "n1: ok" in out.stdout, out.stdout + out.stderr
    bad = run("node", "cordon", "nope", "--reason", "x")
    assert bad.returncode == 2 and "nope" in bad.stderr


def test_bad_input_is_refused_naming_the_field(fleet: Cluster) -> None:
    hdr = {"Authorization": f"Bearer {TOKEN}"}
    r = httpx.post(f"{fleet.url}/v1/nodes/n9/cordon", json={"reason": "x"}, headers=hdr)
    assert r.status_code == 404 and r.json()["field"] == "name"
    assert httpx.get(f"{fleet.url}/v1/nodes/n9", headers=hdr).status_code == 404
    r = httpx.post(f"{fleet.url}/v1/nodes/n1/cordon", json={}, headers=hdr)
    assert r.status_code == 400 and r.json()["field"] == "reason"
    r = httpx.post(f"{fleet.url}/v1/nodes/n1/cordon", json={"reason": "x", "force": True}, headers=hdr)
    assert r.status_code == 400 and r.json()["field"] == "force"
    r = httpx.get(f"{fleet.url}/v1/fleet/events", params={"limit": 0}, headers=hdr)
    assert r.status_code == 400 and r.json()["field"] == "limit"
    with dsec.Client(url=fleet.url, token=TOKEN) as c:  # a reader may see the nodes, not cordon them
        reader = c.create_token("default", "reader").token
    hdr = {"Authorization": f"Bearer {reader}"}
    assert httpx.get(f"{fleet.url}/v1/nodes", headers=hdr).status_code == 200
    assert httpx.post(f"{fleet.url}/v1/nodes/n1/cordon", json={"reason": "x"}, headers=hdr).status_code == 403
    assert httpx.get(f"{fleet.url}/v1/fleet/events", headers=hdr).status_code == 403
