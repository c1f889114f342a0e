"""The edge contract over the wire: the same tests the embedded platform passes (imported
from their modules, where they run against ``dsec serve``), run here against an
apiserver whose edge is a daemon of its own (``dsec edge serve``, reached through
RemoteEdge over HTTP and WebSocket). Then what only the wire has: the cluster secret,
unknown operations, arguments that do not parse, errors keeping their type.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
import websockets
import websockets.exceptions

import dsec
from tests.conftest import SECRET, TOKEN, Cluster, own_cluster

# the suite: the same functions as in their own modules; `platform` below makes them
# run against the remote edge
from tests.test_api import (  # noqa: F401
    test_bad_exec_and_file_requests,
    test_big_file_round_trip,
    test_commands_on_a_stopped_sandbox_get_409,
    test_dropped_stream_stops_its_command,
    test_exec_argv_stdin_env_cwd,
    test_files,
    test_http_to_a_port_inside,
    test_issue_example,
    test_nul_bytes_are_refused,
    test_output_capture_is_bounded,
    test_sessions_are_independent_and_keep_background_jobs,
    test_stop_during_a_command_answers_409,
    test_streaming_output,
    test_timeout_kills_the_command_tree_and_keeps_the_session,
    test_tty,
    test_unknown_and_malformed_ids,
)
from tests.test_branch import (  # noqa: F401
    box,
    test_container_branch_carries_processes_sessions_and_files,
    test_container_branch_refusals_and_a_paused_parent_are_409,
)
from tests.test_density import test_pause_and_resume_a_job, test_pause_pushes_memory_out_and_resume_brings_it_back  # noqa: F401
from tests.test_e2b import (  # noqa: F401
    test_code_interpreter,
    test_commands,
    test_file_metadata_and_watch_entries,
    test_malformed_envd_requests_are_400,
    test_pty,
    test_sandbox_gone_mid_command,
    test_snapshots_and_fork,
    test_watch_dir,
    test_watch_dir_async,
)
from tests.test_e2b import test_files as test_e2b_files  # noqa: F401
from tests.test_fncall import test_cpp_compile_once_run_many_with_verdicts, test_python_hello_and_stdin  # noqa: F401
from tests.test_layers import test_pack_diff_and_fork_reproduce_the_tree  # noqa: F401
from tests.test_lifecycle import test_stop_releases_everything, test_workload_crash_is_contained  # noqa: F401
from tests.test_snapshots_inplace import (  # noqa: F401
    sb,
    test_command_log_after_a_rollback,
    test_rollback_brings_files_back_and_kills_later_processes,
    test_snapshots_are_listed_dropped_and_named,
)


@pytest.fixture(scope="session")
def remote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    yield from own_cluster(tmp_path_factory, "remote-edge")


@pytest.fixture
def platform(remote: Cluster) -> Cluster:
    """This module's platform: the apiserver in front of one edge daemon."""
    return remote


def _edge(remote: Cluster) -> str:
    return remote.edges["n1"].url


def test_every_call_needs_the_cluster_secret(remote: Cluster) -> None:
    url = _edge(remote)
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {SECRET}"}):
        for r in (httpx.get(f"{url}/healthz", headers=headers),
                  httpx.post(f"{url}/v1/call/list_sandboxes", json={}, headers=headers),
                  httpx.post(f"{url}/v1/call/stop", json={"sandbox_id": "n1-x"}, headers=headers)):
            assert r.status_code == 401 and r.json()["error"] == "unauthorized", r.text
    ok = {"Authorization": f"Bearer {SECRET}"}
    assert httpx.post(f"{url}/v1/call/list_sandboxes", json={}, headers=ok).status_code == 200


async def test_streams_need_the_cluster_secret(remote: Cluster) -> None:
    url = _edge(remote).replace("http://", "ws://") + "/v1/stream/watch"
    with pytest.raises(websockets.exceptions.InvalidStatus) as e:
        async with websockets.connect(url, additional_headers={"Authorization": "Bearer wrong"}):
            pass
    assert e.value.response.status_code == 401


def test_unknown_operations_and_bad_arguments_are_4xx(remote: Cluster) -> None:
    url, ok = _edge(remote), {"Authorization": f"Bearer {SECRET}"}
    r = httpx.post(f"{url}/v1/call/rm_rf", json={}, headers=ok)
    assert r.status_code == 404 and "rm_rf" in r.json()["message"]
    r = httpx.post(f"{url}/v1/call/watch", json={}, headers=ok)  # a stream is not a call
    assert r.status_code == 404
    r = httpx.post(f"{url}/v1/call/stop", json={"sandbox_id": 5}, headers=ok)
    assert r.status_code == 400 and r.json()["field"] == "sandbox_id", r.text
    r = httpx.post(f"{url}/v1/call/stop", json={}, headers=ok)
    assert r.status_code == 400 and r.json()["field"] == "sandbox_id"
    r = httpx.post(f"{url}/v1/call/stop", json={"sandbox_id": "n1-x", "extra": 1}, headers=ok)
    assert r.status_code == 400 and r.json()["field"] == "extra"
    r = httpx.post(f"{url}/v1/call/write_file", content=b"no arguments line", headers=ok)
    assert r.status_code == 400 and r.json()["field"] == "body"
    r = httpx.post(f"{url}/v1/call/write_file", content=b'{"path": "/x"}\nbytes', headers=ok)
    assert r.status_code == 400 and r.json()["field"] == "sandbox_id"  # the raw body's siblings are checked
    r = httpx.post(f"{url}/v1/call/stop", content=b"{not json", headers=ok)
    assert r.status_code == 400


async def test_errors_keep_their_type_across_the_wire(remote: Cluster) -> None:
    from dsec.node.edge.remote.client import remote_edge
    from dsec.shared.wire.models import ExecRequest

    edge = remote_edge("n1", _edge(remote), SECRET)
    try:
        with pytest.raises(dsec.NotFound) as nf:
            await edge.get("n1-000000000000")
        assert nf.value.field == "sandbox_id"
        sb = await edge.create(dsec.ContainerArgs(image="base/busybox"))
        try:
            with pytest.raises(dsec.NotFound):
                await edge.read_file(sb.sandbox_id, "/no/such/file")
            with pytest.raises(dsec.InvalidRequest) as bad:
                await edge.set_network_rules(sb.sandbox_id, {"no-such-service": True})
            assert bad.value.field
            with pytest.raises(dsec.NotFound):  # from a stream, before its first item
                async for _ in edge.exec_stream("n1-000000000000", ExecRequest(cmd="true")):
                    pass
            # a stream's items, then its end
            events = [e async for e in edge.exec_stream(sb.sandbox_id, ExecRequest(cmd="echo a; echo b >&2"))]
            assert [e.type for e in events][-1] == "result" and events[-1].result is not None
            assert events[-1].result.stdout == "a\n" and events[-1].result.stderr == "b\n"
        finally:
            await edge.stop(sb.sandbox_id)
        with pytest.raises(dsec.SandboxNotRunning):
            await edge.exec(sb.sandbox_id, ExecRequest(cmd="true"))
    finally:
        await edge.close()
    wrong = remote_edge("n1", _edge(remote), "not-the-secret-at-all")
    try:
        with pytest.raises(dsec.Unauthorized):
            await wrong.list_sandboxes()
        with pytest.raises(dsec.Unauthorized):
            async for _ in wrong.watch("n1-x", "/", False):
                pass
    finally:
        await wrong.close()
    gone = remote_edge("n9", "http://127.0.0.1:9", SECRET)  # nothing listens on the discard port
    try:
        with pytest.raises(dsec.EdgeUnavailable, match="n9"):
            await gone.stats()
    finally:
        await gone.close()


def test_sandbox_ids_name_the_remote_edge(remote: Cluster) -> None:
    with dsec.Client(url=remote.url, token=TOKEN) as c:
        sb = c.run_container(dsec.ContainerArgs(image="base/busybox"))
        try:
            assert sb.sandbox_id.startswith("n1-")
            nodes = c.nodes()
            assert [n.edge for n in nodes] == ["n1"] and nodes[0].healthy
            metrics = httpx.get(f"{remote.url}/metrics", headers={"Authorization": f"Bearer {TOKEN}"}).text
            assert 'dsec_sandboxes_created_total{edge="n1"}' in metrics
        finally:
            sb.stop()
    assert json.loads(httpx.get(f"{_edge(remote)}/healthz",
                                headers={"Authorization": f"Bearer {SECRET}"}).text)["edge"] == "n1"


async def test_a_call_given_up_on_is_cancelled_at_the_edge(remote: Cluster) -> None:
    """Calls share one connection; a caller that gives up on one (its request was
    dropped) ends the work at the edge, and the connection serves on."""
    import asyncio

    from dsec.node.edge.remote.client import remote_edge
    from dsec.shared.wire.models import ExecRequest

    edge = remote_edge("n1", _edge(remote), SECRET)
    try:
        sb = await edge.create(dsec.ContainerArgs(image="base/busybox"))
        try:
            call = asyncio.ensure_future(edge.exec(sb.sandbox_id, ExecRequest(cmd="sleep 60; echo done")))
            for _ in range(50):
                running = await edge.exec(sb.sandbox_id, ExecRequest(cmd="ps -o args | grep -c '^sleep 60'"))
                if running.stdout.strip() == "1":
                    break
                await asyncio.sleep(0.1)
            assert running.stdout.strip() == "1" and not call.done()
            call.cancel()
            for _ in range(50):
                left = await edge.exec(sb.sandbox_id, ExecRequest(cmd="ps -o args | grep -c '^sleep 60'"))
                if left.stdout.strip() == "0":
                    break
                await asyncio.sleep(0.1)
            assert left.stdout.strip() == "0"
            many = await asyncio.gather(*(edge.exec(sb.sandbox_id, ExecRequest(cmd=f"echo {i}")) for i in range(50)))
            assert [r.stdout for r in many] == [f"{i}\n" for i in range(50)]  # matched by id, out of order or not
        finally:
            await edge.stop(sb.sandbox_id)
    finally:
        await edge.close()
