"""dsec on a real multi-node Ray cluster on this machine (dsec.control.cluster.local): three
raylets, each with the dsec_edge resource and a dsec-edge-name label, a private
PostgreSQL and a MooseFS store started here, and `dsec cluster up` (as a function)
putting an edge daemon on every node and two apiserver replicas in front.
Nothing is mocked: the edges are real daemons with their own data dirs, cgroup parents,
subnets and nftables tables, owned by Ray actors.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import ray
import websockets

import dsec
from dsec.control.cluster import ops, rayauth
from dsec.control.cluster.config import NAMESPACE
from dsec.control.cluster.local import LocalCluster
from dsec.shared.wire.models import FNCALL_IMAGE
from tests.conftest import SHARED_LAYERS, SRC_DATA, _seed_vm

NAMES = ("r1", "r2", "r3")


@dataclass
class RayDsec:
    local: LocalCluster
    token: str

    @property
    def urls(self) -> list[str]:
        """The replicas where they are now: Ray restarts one that died (a killed replica, or
        one on a node that went) on a free port, as dsec.control.cluster.local runs them."""
        deadline = time.monotonic() + 60
        while True:
            try:
                found = ops.status(self.address)["apiservers"]
                return [found[k] for k in sorted(found)]
            except ray.exceptions.RayError:  # the controller is being restarted
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    @property
    def url(self) -> str:
        return ",".join(self.urls)

    @property
    def address(self) -> str:
        return self.local.address

    def client(self, url: str | None = None) -> dsec.AsyncClient:
        return dsec.AsyncClient(url=url or self.urls[0], token=self.token)


@pytest.fixture(scope="module")
def rc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayDsec]:
    local = LocalCluster(str(tmp_path_factory.mktemp("ray-dsec")), NAMES, os.path.join(SRC_DATA, "layers"),
                         SHARED_LAYERS | {FNCALL_IMAGE}, seed=_seed_vm)
    try:
        up = local.start()
        yield RayDsec(local, up.token)
    finally:
        failed = local.stop()
        assert not failed, failed


def _info(actor: Any) -> dict[str, Any]:
    info: dict[str, Any] = ray.get(actor.info.remote(), timeout=60)
    return info


def _brief(rc: RayDsec) -> str:
    """The cluster as the controller and Ray see it, for a failure message."""
    st = ops.status(rc.address)
    edges = [(e["name"], e["node_id"][:8], e["state"], e["healthy"], e["reason"]) for e in st["edges"]]
    nodes = [(n["NodeID"][:8], n["Alive"]) for n in ray.nodes()]
    return (f"edges {edges}; ray nodes {nodes}; round {st['round']}; error {st['last_error']!r}; "
            f"events {st['events'][-8:]}")


async def _restarted(actor: Any, old_pid: int) -> bool:
    try:
        return bool(await asyncio.to_thread(lambda: _info(actor)["pid"] != old_pid))
    except ray.exceptions.RayError:  # restarting
        return False


def _edge(sandbox_id: str) -> str:
    return sandbox_id.rsplit("-", 1)[0]


async def _until(check: Any, what: str, timeout: float = 30.0, state: Callable[[], object] | None = None) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = await check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:g} s: {what}" + (f"; state: {state()}" if state else ""))
        await asyncio.sleep(0.2)


async def test_creates_spread_and_any_replica_reaches_any_edge(rc: RayDsec) -> None:
    urls = rc.urls
    async with rc.client(urls[0]) as a, rc.client(urls[1]) as b:
        assert {n.edge for n in await a.nodes()} == set(NAMES) == {n.edge for n in await b.nodes()}
        made = await asyncio.gather(*(c.run_container(dsec.ContainerArgs(image="base/busybox", job="spread"))
                                      for c in (a, b) * 6))
        kids: list[dsec.AsyncSandbox] = []
        try:
            assert {_edge(sb.sandbox_id) for sb in made} == set(NAMES)
            for sb in made[:3]:
                via_b = await b.connect(sb.sandbox_id)
                assert (await via_b.exec(["sh", "-c", "echo hi"])).stdout == "hi\n"
                await via_b.run_shell("cd /tmp && export X=42", session="s1")  # a session keeps its state
                assert (await sb.run_shell("echo $PWD $X", session="s1")).stdout == "/tmp 42\n"
                await sb.write_file("/tmp/f.txt", b"data-" + sb.sandbox_id.encode())
                assert await via_b.read_file("/tmp/f.txt") == b"data-" + sb.sandbox_id.encode()
            async with websockets.connect(made[1].tty_url(90, 20).replace(urls[0], urls[1]),
                                          additional_headers={"Authorization": f"Bearer {rc.token}"}) as ws:
                await ws.send(b"stty size; echo tty-$((6*7))\n")
                buf = b""
                while b"tty-42" not in buf:
                    buf += await asyncio.wait_for(ws.recv(), 10)  # type: ignore[operator]
                assert b"20 90" in buf
            listed = {i.sandbox_id for i in await b.list(job="spread")}
            assert listed == {sb.sandbox_id for sb in made}
            src = made[0]
            await src.exec("mkdir -p /work && echo from-$(hostname) > /work/origin")
            snap = await src.pack_diff(f"ws/ray-fork-{src.sandbox_id}:v1")  # through replica a
            kids = await b.fork(snap, n=6)  # through replica b, children on other edges than the snapshot's
            # (placement's choice: an edge the detector holds suspect, the busy head node, may get none)
            assert len({_edge(k.sandbox_id) for k in kids}) >= 2
            assert {_edge(k.sandbox_id) for k in kids} - {_edge(src.sandbox_id)}
            for k in kids:
                assert (await k.exec("cat /work/origin")).stdout == f"from-{src.sandbox_id}\n"
            r = await a.fncall(dsec.FnCallArgs(language="python", code="print(sum(map(int, input().split())))",
                                               stdin="2 3\n"))
            assert r.status == "ok" and r.stdout == "5\n", r
            assert r.container.rsplit("-", 1)[0] in NAMES
        finally:
            await b.stop_many(job="spread")
            await asyncio.gather(*(k.stop() for k in kids))


def test_an_edge_refuses_callers_without_a_cluster_certificate_or_the_secret(rc: RayDsec) -> None:
    """Mutual TLS on the edge wire (docs/cluster.md, "TLS"): a caller without a certificate
    the cluster CA signed is refused at the handshake; with one, the secret is still asked."""
    import ssl

    from dsec.control.cluster import certs
    from dsec.shared.meta import open_db
    from dsec.shared.meta.registry import Registry

    edges = ops.status(rc.address)["edges"]
    url = next(e["url"] for e in edges if e["name"] == "r2")
    assert url.startswith("https://")
    ca = os.path.join(rc.local.root, "tls", "ca.crt")  # `cluster up` left the CA here
    assert oct(os.stat(os.path.join(rc.local.root, "tls", "ca.key")).st_mode & 0o777) == "0o600"
    with pytest.raises(httpx.TransportError):  # no client certificate
        httpx.post(f"{url}/v1/call/stats", json={}, verify=ssl.create_default_context(cafile=ca))
    with pytest.raises(httpx.TransportError):  # plain HTTP
        httpx.post(url.replace("https://", "http://") + "/v1/call/stats", json={})
    assert rc.local.up is not None
    mine = certs.daemon_files(Registry(open_db(rc.local.up.db, migrate=False)),
                              os.path.join(rc.local.root, "test-client"), "testclient", ["127.0.0.1"])
    ctx = ssl.create_default_context(cafile=mine.ca)
    ctx.load_cert_chain(mine.cert, mine.key)
    assert httpx.post(f"{url}/v1/call/stats", json={}, verify=ctx).status_code == 401
    assert httpx.post(f"{url}/v1/call/stats", json={}, verify=ctx,
                      headers={"Authorization": f"Bearer {rc.token}"}).status_code == 401  # the API token is not it


def test_ray_refuses_a_client_without_the_token(rc: RayDsec) -> None:
    """Every raylet and the GCS run with token auth (dsec.control.cluster.rayauth): a driver
    without the token, or with another, cannot connect."""
    code = ("import ray, sys\n"
            "try:\n"
            f"    ray.init(address={rc.address!r}, logging_level='error')\n"
            "except Exception as e:\n"
            "    print('refused:', type(e).__name__, str(e)[:200]); sys.exit(3)\n"
            "print('connected', ray.cluster_resources())\n")
    base = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    for env in ({**base, "HOME": rc.local.root},  # no token anywhere
                {**base, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 64}):  # a wrong one
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode != 0 and "connected" not in out.stdout, (out.stdout, out.stderr[-2000:])
    # and the same driver with the token gets in: what refused the others was the token
    out = subprocess.run([sys.executable, "-c", code], env={**base, **rayauth.env(rc.local.ray_token)},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "connected" in out.stdout, (out.stdout, out.stderr[-2000:])
    # the token file is the operator's only: 0600
    assert oct(os.stat(rc.local.ray_token).st_mode & 0o777) == "0o600"


async def test_rotate_certs_with_a_new_ca_drops_no_sandbox(rc: RayDsec) -> None:
    async with rc.client(rc.url) as c:
        sb = await c.run_container(dsec.ContainerArgs(image="base/busybox"))
        try:
            in_flight = asyncio.create_task(sb.exec("sleep 3; echo survived", timeout=60))
            done = await asyncio.to_thread(ops.rotate_certs, rc.address, True)
            assert done["new_ca"] and done["daemons"] == len(NAMES) + 2 + 1  # edges, replicas, controller
            assert (await in_flight).stdout == "survived\n"
            assert (await sb.exec("echo after")).stdout == "after\n"
            edges = ops.status(rc.address)["edges"]
            assert all(e["healthy"] for e in edges if e["name"] in NAMES), edges
        finally:
            await sb.stop()


def test_e2b_sdk_through_a_replica(rc: RayDsec, monkeypatch: pytest.MonkeyPatch) -> None:
    from e2b import Sandbox

    url = rc.urls[1]
    monkeypatch.setenv("E2B_API_URL", url)
    monkeypatch.setenv("E2B_SANDBOX_URL", url)
    monkeypatch.setenv("E2B_API_KEY", rc.token)
    sbx = Sandbox.create("base/debian:12", timeout=300)
    try:
        assert sbx.commands.run("echo hello").stdout == "hello\n"
        sbx.files.write("/root/x.txt", "hi")
        assert sbx.files.read("/root/x.txt") == "hi"
    finally:
        sbx.kill()


async def test_edge_actor_killed_ray_restarts_it_and_it_readopts(rc: RayDsec) -> None:
    async with rc.client() as c:
        made = await asyncio.gather(*(c.run_container(dsec.ContainerArgs(image="base/busybox")) for _ in range(6)))
        victim = _edge(made[0].sandbox_id)
        on_r2 = [sb for sb in made if _edge(sb.sandbox_id) == victim]
        try:
            for sb in on_r2:
                await sb.exec("echo before > /tmp/mark")
            actor = ray.get_actor(f"edge:{victim}", namespace=NAMESPACE)
            old_pid = _info(actor)["pid"]
            ray.kill(actor, no_restart=False)  # the actor process dies; its daemon with it; Ray restarts both

            await _until(lambda: _restarted(actor, old_pid), f"Ray restarts {victim}'s edge actor and daemon", 90)

            async def back() -> bool:  # through every replica: each reads the edge's new address
                try:
                    for url in rc.urls:
                        async with rc.client(url) as via:
                            sb = await via.connect(on_r2[0].sandbox_id)
                            if (await sb.exec("cat /tmp/mark")).stdout != "before\n":
                                return False
                    return True
                except dsec.DsecError:
                    return False
            await _until(back, f"{victim}'s sandbox answers again after Ray restarted its edge", 30)
            for sb in on_r2:  # re-adopted, state intact
                assert (await sb.exec("cat /tmp/mark")).stdout == "before\n"
        finally:
            await asyncio.gather(*(sb.stop() for sb in made))


async def test_replica_killed_mid_burst_the_sdk_fails_over(rc: RayDsec) -> None:
    actor = ray.get_actor("apiserver:0", namespace=NAMESPACE)
    pid = _info(actor)["pid"]
    urls = rc.urls
    async with rc.client(",".join(urls)) as c:  # both replicas, the first in use
        sbs = await asyncio.gather(*(c.run_container(dsec.ContainerArgs(image="base/busybox", job="failover"))
                                     for _ in range(3)))
        outcomes: list[object] = []

        async def worker(n: int) -> None:
            for i in range(12):
                sb = sbs[(n + i) % len(sbs)]
                try:
                    outcomes.append((await sb.exec(f"echo {n}-{i}")).stdout)
                except dsec.EdgeUnavailable as e:  # in flight on the killed replica: not repeated
                    assert "not repeated" in e.message or "unknown" in e.message, e
                    outcomes.append(e)
                await asyncio.sleep(0.02)

        work = asyncio.gather(*(worker(n) for n in range(6)))
        await asyncio.sleep(0.3)
        os.kill(pid, signal.SIGKILL)
        await work
        answered = [o for o in outcomes if isinstance(o, str)]
        assert len(answered) >= len(outcomes) - 6 and len(outcomes) == 72  # at most one per worker in flight
        assert c.url == urls[1]  # moved to the live replica
        listed = {i.sandbox_id for i in await c.list(job="failover")}
        assert listed == {sb.sandbox_id for sb in sbs}
        await c.stop_many(job="failover")

    await _until(lambda: _restarted(actor, pid), "Ray restarts the killed replica", 90)


async def test_node_lost_mid_burst(rc: RayDsec) -> None:
    async with rc.client(rc.url) as c:
        pre: list[dsec.AsyncSandbox] = []
        while not any(_edge(sb.sandbox_id) != NAMES[0] for sb in pre):  # the head node cannot be removed
            assert len(pre) < 30, "nothing placed on the non-head nodes"
            pre += await asyncio.gather(*(c.run_container(dsec.ContainerArgs(image="base/busybox", job="pre"))
                                          for _ in range(3)))
        victim = next(_edge(sb.sandbox_id) for sb in pre if _edge(sb.sandbox_id) != NAMES[0])
        lost = [sb for sb in pre if _edge(sb.sandbox_id) == victim]
        try:
            burst = [asyncio.create_task(c.run_container(dsec.ContainerArgs(image="base/busybox", job="burst")))
                     for _ in range(12)]
            await asyncio.sleep(0.2)
            await asyncio.to_thread(rc.local.remove_node, victim)  # the raylet dies
            made = await asyncio.gather(*burst)  # every accepted create ends running: re-placed if it must
            survivors = [sb for sb in made if _edge(sb.sandbox_id) != victim]
            lost += [sb for sb in made if _edge(sb.sandbox_id) == victim]  # done before the node died

            async def marked() -> bool:
                try:
                    info = await c.connect(lost[0].sandbox_id)
                except dsec.EdgeUnavailable:  # gone, not yet declared lost
                    return False
                return info.info.state == "failed" and "node lost" in (info.info.error or "")
            await _until(marked, "the lost node's sandboxes are reported failed", 60, lambda: _brief(rc))
            for sb in lost:
                info = (await c.connect(sb.sandbox_id)).info
                assert info.state == "failed" and info.error == "node lost", info
                with pytest.raises(dsec.EdgeUnavailable, match="lost"):
                    await sb.exec("true")
            for sb in survivors:
                assert (await sb.exec("echo alive")).stdout == "alive\n"
            by_id = {i.sandbox_id: i for i in await c.list(job="pre")}
            assert all(by_id[sb.sandbox_id].state == "failed" for sb in lost if sb in pre)
            fresh = await asyncio.gather(*(c.run_container(dsec.ContainerArgs(image="base/busybox", job="burst"))
                                           for _ in range(6)))
            assert victim not in {_edge(sb.sandbox_id) for sb in fresh}
            edges = {e["name"]: e for e in ops.status(rc.address)["edges"]}
            assert edges[victim]["state"] == "lost" and "node lost" in edges[victim]["reason"]

        finally:  # the node comes back (also should the test fail: its edge cleans up what is left there)
            if victim not in rc.local.nodes:
                rc.local.add_node(victim)
        # the returned node's edge takes what is left there and stops it

        async def cleaned() -> bool:
            try:
                info = await c.connect(lost[0].sandbox_id)
            except dsec.DsecError:
                return False
            return info.info.state == "stopped"
        await _until(cleaned, "the returned edge stops what the cluster reported failed", 90)
        assert {e["name"]: e["state"] for e in ops.status(rc.address)["edges"]}[victim] == "active"
        await c.stop_many(job="burst")
        await c.stop_many(job="pre")


async def test_controller_killed_ray_restarts_it_and_it_rebuilds_its_view(rc: RayDsec) -> None:
    """The controller holds nothing it cannot rebuild from Ray and the registry: killed, it is
    restarted by Ray, finds every edge again, and (the next test) still starts an edge on a
    node that joins after."""
    url = rc.url
    ctl = ray.get_actor("controller", namespace=NAMESPACE)
    ray.kill(ctl, no_restart=False)
    async with rc.client(url) as c:
        sb = await c.run_container(dsec.ContainerArgs(image="base/busybox"))  # the replicas do not need it
        assert (await sb.exec("echo ok")).stdout == "ok\n"
        await sb.stop()

    async def rebuilt() -> bool:
        try:
            st = await asyncio.to_thread(ops.status, rc.address)
        except ray.exceptions.RayError:
            return False
        return {e["name"] for e in st["edges"] if e["state"] == "active" and e["healthy"]} >= set(NAMES)
    await _until(rebuilt, "the restarted controller sees every edge healthy", 60)


async def test_a_node_joining_later_takes_load(rc: RayDsec) -> None:
    rc.local.add_node("r4")
    async with rc.client(rc.url) as c:
        # placement prefers edges whose health is ok (a new edge on a busy machine can be
        # suspect for a few rounds, e.g. its first polls slow): wait for what placement waits for
        async def serving() -> bool:
            return any(n.edge == "r4" and n.healthy and n.health == "ok" for n in await c.nodes())
        await _until(serving, "an edge on the new node, healthy and ok", 90)
        made = await asyncio.gather(*(c.run_container(dsec.ContainerArgs(image="base/busybox", job="join"))
                                      for _ in range(8)))
        nodes = [(n.edge, n.healthy, n.health, n.sandboxes, n.evidence) for n in await c.nodes()]
        assert "r4" in {_edge(sb.sandbox_id) for sb in made}, nodes
        await c.stop_many(job="join")


async def test_a_token_made_on_one_replica_works_on_the_other_and_revocation_reaches_it(rc: RayDsec) -> None:
    urls = ops.status(rc.address)["apiservers"]  # replica 0 was restarted (on a free port) above
    a_url, b_url = urls["apiserver:0"], urls["apiserver:1"]
    async with rc.client(a_url) as admin_a:
        made = await admin_a.create_token("team-x", "runner", "trainer")
    assert made.token
    async with dsec.AsyncClient(url=b_url, token=made.token) as b:
        sb = await b.run_container(dsec.ContainerArgs(image="base/busybox"))  # at once, on the other replica
        assert sb.info.labels["dsec.project"] == "team-x"
        await sb.stop()
        async with rc.client(a_url) as admin_a:
            await admin_a.revoke_token(made.id)

        async def refused() -> bool:
            try:
                await b.list()
            except dsec.Unauthorized:
                return True
            return False
        await _until(refused, "the other replica refuses a revoked token", 15)


async def test_a_project_quota_holds_when_two_replicas_race_for_the_last_units(rc: RayDsec) -> None:
    """Creates for one project through both replicas at once: admission is a conditional
    update of the project's usage row in PostgreSQL, so exactly the quota is made, whichever
    replica each create went to, and the rest are 429s naming the project."""
    urls = ops.status(rc.address)["apiservers"]
    a_url, b_url = urls["apiserver:0"], urls["apiserver:1"]
    async with rc.client(a_url) as admin:
        await admin.projects.create("race-team", dsec.ProjectQuota(sandboxes=5))
        token = (await admin.create_token("race-team", "runner")).token
    assert token
    args = dsec.ContainerArgs(image="base/busybox", memory_limit_mb=64, cpu_cores_limit=0.25)
    async with dsec.AsyncClient(url=a_url, token=token) as a, dsec.AsyncClient(url=b_url, token=token) as b:
        results = await asyncio.gather(*(c.run_container(args) for c in (a, b) * 6), return_exceptions=True)
        made = [r for r in results if isinstance(r, dsec.AsyncSandbox)]
        refused = [r for r in results if isinstance(r, dsec.QuotaExceeded)]
        try:
            assert len(made) == 5 and len(refused) == 7, results
            assert all("'race-team'" in e.message and e.field == "quota.sandboxes" for e in refused)
            assert (await b.projects.get("race-team")).usage.sandboxes == 5
        finally:
            await asyncio.gather(*(sb.stop() for sb in made))
        assert (await b.projects.get("race-team")).usage.sandboxes == 0  # stopped through a, freed for b


def test_cluster_cli(rc: RayDsec, tmp_path: Any) -> None:
    import subprocess
    import sys

    cli = [sys.executable, "-m", "dsec.client.cli.main"]
    out = subprocess.run([*cli, "cluster", "status", "--ray-address", rc.address, "--json"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert {e["name"] for e in json.loads(out.stdout)["edges"] if e["state"] == "active"} >= set(NAMES)
    env = {**os.environ, "DSEC_URL": rc.url, "DSEC_TOKEN": rc.token}
    out = subprocess.run([*cli, "nodes"], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0 and all(n in out.stdout for n in NAMES), out.stdout + out.stderr
    bad = subprocess.run([*cli, "cluster", "up", "--ray-address", rc.address], capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and "--store" in bad.stderr
    key = tmp_path / "k"
    key.write_text("x" * 32)
    bad = subprocess.run([*cli, "apiserver", "--secret-file", str(key), "--db", "postgresql://dsec@127.0.0.1:1/dsec",
                          "--token", "t" * 20], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--db" in bad.stderr and "Traceback" not in bad.stderr, bad.stderr


async def test_nodes_and_a_cordon_by_hand_through_the_replicas(rc: RayDsec) -> None:
    """The fleet's health through the replicas (read from the registry the controller's
    detector writes): a cordon made on one replica is seen on the other and keeps creates off
    that edge; the uncordon on the other lifts it, and both are events."""
    a_url, b_url = rc.urls[:2]
    async with rc.client(a_url) as a, rc.client(b_url) as b:
        up = sorted(n.edge for n in await a.nodes() if n.state == "up" and n.health == "ok")
        assert len(up) >= 2, [(n.edge, n.state, n.health) for n in await a.nodes()]
        target = up[0]
        node = await a.nodes.cordon(target, "ray test: by hand")
        made: list[dsec.AsyncSandbox] = []
        try:
            assert node.health == "cordoned" and node.cordoned_by not in ("", "detector")
            assert (await b.nodes.get(target)).health == "cordoned"
            made = [await b.run_container(dsec.ContainerArgs(image="base/busybox")) for _ in range(4)]
            assert target not in {_edge(s.sandbox_id) for s in made}
        finally:
            await asyncio.gather(*(s.stop() for s in made))
            node = await b.nodes.uncordon(target)
        assert node.health == "ok"
        kinds = [(e.kind, e.reason) for e in await a.nodes.events(target)]
        assert ("cordoned", "ray test: by hand") in kinds and kinds[-1][0] == "uncordoned"


# every (address, port) given on the command line tried at once from inside a sandbox, each
# bounded: prints those that connected, then how many were tried
PROBE = r"""
import asyncio, sys
async def one(host, port, hit):
    try:
        _, w = await asyncio.wait_for(asyncio.open_connection(host, port), 1.5)
        hit.append(f"{host}:{port}"); w.close()
    except (OSError, asyncio.TimeoutError):
        pass
async def main():
    hit, sem = [], asyncio.Semaphore(256)
    async def bounded(h, p):
        async with sem:
            await one(h, p, hit)
    targets = [(t.rsplit(":", 1)[0], int(t.rsplit(":", 1)[1])) for t in sys.argv[1:]]
    await asyncio.gather(*(bounded(h, p) for h, p in targets))
    print("connected:", " ".join(sorted(hit)))
    print("tried:", len(targets))
asyncio.run(main())
"""


def _listening_ports() -> set[int]:
    """Every TCP port this machine listens on (its own network namespace), IPv4 and IPv6."""
    ports = set()
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(path) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                if state == "0A":  # LISTEN
                    ports.add(int(local.rsplit(":", 1)[1], 16))
    return ports


def _own_ipv4() -> list[str]:
    """This machine's IPv4 addresses but loopback (inside a sandbox, 127.0.0.1 is its own) and
    the sandboxes' link ends."""
    import ipaddress
    import subprocess

    from dsec.node.edge.network.rules import POOL

    out = json.loads(subprocess.run(["ip", "-j", "-4", "addr"], capture_output=True, text=True, check=True).stdout)
    addrs = {a["local"] for link in out for a in link.get("addr_info", [])}
    return sorted(a for a in addrs if not a.startswith("127.") and ipaddress.IPv4Address(a) not in POOL)


async def test_sandboxes_reach_none_of_the_clusters_own_services(rc: RayDsec) -> None:
    """Red team from inside containers on every node: each TCP port this machine listens on
    (Ray's GCS, raylets, object managers and workers, PostgreSQL, the MooseFS master and
    chunkserver, the edges, the replicas; read from /proc/net/tcp*), at each of its
    addresses, is out of reach; a raw rule naming a Ray node's address is a 400 naming
    it; the cluster's addresses are published and in every edge's nft set; a microVM has
    no network device at all."""
    import hashlib
    from urllib.parse import urlsplit

    from dsec.node.edge.network import wall
    from dsec.node.edge.network.nft import LibNft
    from dsec.shared.meta import open_db
    from dsec.shared.meta.registry import Registry

    assert rc.local.up is not None
    registry = Registry(open_db(rc.local.up.db, migrate=False))
    nodes = {n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
    db_host = wall.url_host(rc.local.up.db)
    assert db_host and wall.moosefs_master(rc.local.store) == rc.local.fs.client_host

    async def published() -> Any:
        found = json.loads(await asyncio.to_thread(registry.setting, wall.SETTING) or "[]")
        need = {wall.entry(x) for x in (*nodes, db_host, rc.local.fs.client_host)}
        return need <= set(found) and found
    entries = await _until(published, "the controller publishes the cluster's addresses", state=lambda: _brief(rc))
    edges_published = await asyncio.to_thread(registry.settings_like, wall.SETTING + ":edge:")
    assert {k.rsplit(":", 1)[1] for k in edges_published} >= set(NAMES), edges_published
    own = _own_ipv4()
    assert own, "no address of this machine to try"
    for name in NAMES:  # each edge's table holds them (the node's own addresses too)
        root = os.path.join(os.path.abspath(os.path.join(rc.local.root, name)), "edges", name)
        table = "dsec_" + hashlib.sha1(root.encode()).hexdigest()[:8]

        async def in_set(table: str = table) -> bool:
            text = await asyncio.to_thread(LibNft().run, f"list set inet {table} cluster")
            return all(a in text for a in own)
        await _until(in_set, f"edge {name}'s nft set holds this node's addresses")
    assert entries

    ports = _listening_ports()
    urls = [*rc.urls, *(e["url"] for e in ops.status(rc.address)["edges"])]
    must = {urlsplit(u).port for u in urls} | {int(urlsplit(rc.local.up.db.replace("postgresql", "http")).port or 0)}
    assert must <= ports, (must - ports, "the services' ports are read from /proc/net/tcp")
    targets = [f"{a}:{p}" for a in own for p in sorted(ports)]
    async with rc.client() as c:
        sbs = await asyncio.gather(*(c.run_container(dsec.ContainerArgs(network_rules={}, job="red-team"))
                                     for _ in range(3)))
        try:
            for sb in sbs:
                r = await sb.exec(["python3", "-c", PROBE, *targets], timeout=120)
                assert r.exit_code == 0, r.stderr
                assert f"tried: {len(targets)}" in r.stdout and "connected: \n" in r.stdout + "\n", (
                    _edge(sb.sandbox_id), r.stdout[-2000:])
            # a raw rule naming a Ray node's address is refused, naming it, on create and on change
            node = sorted(nodes)[0]
            with pytest.raises(dsec.InvalidRequest) as e:
                await c.run_container(dsec.ContainerArgs(network_rules={f"{node}:6379/tcp": True}))
            assert e.value.field == "network_rules" and node in e.value.message and "cluster" in e.value.message
            with pytest.raises(dsec.InvalidRequest) as e:
                await sbs[0].set_network_rules({f"{node}:{min(ports)}/tcp": True})
            assert node in e.value.message and "cluster" in e.value.message
        finally:
            await asyncio.gather(*(sb.stop() for sb in sbs))
        if not os.path.isdir(os.path.join(SRC_DATA, "vm", "guest")):
            pytest.fail("no VM guest prepared (scripts/setup.sh): the microVM half of this test cannot run")
        vm = await c.run_microvm(dsec.MicroVMArgs(memory_mb=256, job="red-team"))
        try:  # no NIC at all (qemu -nodefaults, none added): nothing to reach anything with
            r = await vm.run_shell("ls /sys/class/net; ip route 2>/dev/null || cat /proc/net/route")
            assert r.stdout.split()[0] == "lo" and "eth" not in r.stdout and "default" not in r.stdout, r.stdout
            r = await vm.exec(["python3", "-c", PROBE, *targets[:50]], timeout=60)
            assert "connected: \n" in r.stdout + "\n", r.stdout
        finally:
            await vm.stop()
