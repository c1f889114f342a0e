"""The edge as composed parts (dsec.node.edge.service): no stub for one part to fill in
for another, a facade that inherits none of them, and one table of which operation is
legal in which state (dsec.node.edge.lifecycle.LEGAL) that covers every operation of the
contract naming a sandbox; its transitions are checked on a hollow edge in this process
(the real edge and all its parts over a runtime that starts nothing, so each step is read
off the edge object) and through the real embedded edge of ``dsec serve``."""

from __future__ import annotations

import ast
import inspect
import os
from collections.abc import AsyncIterator

import pytest

import dsec
from dsec.node.edge import api as edge_api
from dsec.node.edge.accesslists import AccessLists
from dsec.node.edge.auditing import Auditing
from dsec.node.edge.capacity import Capacity
from dsec.node.edge.chains import CheckpointChains
from dsec.node.edge.checkpointing import Checkpointing
from dsec.node.edge.core import EdgeNode
from dsec.node.edge.creation import Creation
from dsec.node.edge.interactive import Interactive
from dsec.node.edge.keyed import KeyedExec
from dsec.node.edge.lifecycle import LEGAL, RESUMES, Lifecycle, Op, State, state_of
from dsec.node.edge.recovery import Recovery
from dsec.node.edge.remote.hollow import start_fleet, stop_fleet
from dsec.node.edge.rollback import InplaceSnapshots
from dsec.node.edge.runner import CommandRunner
from dsec.node.edge.service import Edge
from dsec.node.edge.snapshots import Snapshots
from dsec.node.edge.sweepers import Sweepers
from dsec.node.edge.table import SandboxTable
from dsec.node.edge.teardown import Teardown
from dsec.shared.errors import InvalidRequest, NotFound, SandboxNotRunning
from dsec.shared.wire.models import ContainerArgs, ExecRequest, SandboxState

EDGE_DIR = os.path.dirname(inspect.getfile(Edge))
PARTS = (SandboxTable, EdgeNode, Lifecycle, Creation, Teardown, Recovery, Capacity, Sweepers, Auditing, KeyedExec,
         CommandRunner, Interactive, Snapshots, AccessLists, Checkpointing, CheckpointChains, InplaceSnapshots)


def _edge_sources() -> dict[str, str]:
    out = {}
    for top, _, files in os.walk(EDGE_DIR):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(top, f)
                out[os.path.relpath(path, EDGE_DIR)] = open(path).read()
    return out


def test_no_not_implemented_stub_in_the_edge() -> None:
    sources = _edge_sources()
    assert "service.py" in sources and len(sources) > 20
    stubs = [name for name, text in sources.items()
             for node in ast.walk(ast.parse(text)) if isinstance(node, ast.Raise) and node.exc is not None
             and "NotImplementedError" in ast.unparse(node.exc)]
    assert stubs == []


def test_the_edge_is_composed_not_inherited() -> None:
    assert Edge.__bases__ == (object,)
    for part in PARTS:
        assert part.__bases__ == (object,), f"{part.__name__} inherits {part.__bases__}"
        assert not (set(part.__mro__[1:]) & set(PARTS))
    # each part is built with its collaborators: the constructor names what it uses
    for part in (Lifecycle, Creation, Teardown, Checkpointing, Sweepers, Interactive, KeyedExec):
        assert len(inspect.signature(part).parameters) >= 3, part.__name__
    # every module of the edge says what it owns
    for name, text in _edge_sources().items():
        if text.strip():
            assert ast.get_docstring(ast.parse(text)), f"{name} has no docstring"


def test_the_state_table_covers_every_operation_that_names_a_sandbox() -> None:
    named = {name for name, fn in inspect.getmembers(edge_api.EdgeAPI, inspect.isfunction)
             if "sandbox_id" in inspect.signature(fn).parameters}
    assert {"exec", "stop", "pause", "rollback", "checkpoint", "tty", "watcher_remove"} <= named
    assert named <= {op.value for op in LEGAL}, named - {op.value for op in LEGAL}
    assert set(Op) == set(LEGAL)
    # records answer whatever the state; requests into the sandbox need it running
    assert LEGAL[Op.GET] == set(State) and LEGAL[Op.EXEC] == {State.RUNNING} and Op.EXEC in RESUMES
    assert State.ENDED not in LEGAL[Op.CHECKPOINT] and Op.PAUSE not in RESUMES
    assert state_of(None) == State.ENDED


@pytest.fixture
async def edge(tmp_path: os.PathLike[str]) -> AsyncIterator[Edge]:
    fleet = await start_fleet(1, "p", os.path.join(tmp_path, "fleet"), "secret-" + "x" * 32, cfg={})
    try:
        yield fleet[0].edge
    finally:
        await stop_fleet(fleet)


async def test_transitions_on_an_edge(edge: Edge) -> None:
    info = await edge.create(ContainerArgs(image="base/busybox"))
    sid = info.sandbox_id
    assert state_of(edge.sandboxes[sid]) == State.RUNNING
    assert (await edge.exec(sid, ExecRequest(cmd="true"))).exit_code == 0

    # a paused sandbox: pause again answers as it is; a request into it resumes it first
    assert (await edge.pause(sid)).state == SandboxState.paused
    assert state_of(edge.sandboxes[sid]) == State.PAUSED
    assert (await edge.pause(sid)).state == SandboxState.paused
    assert (await edge.usage(sid)).cpu_s >= 0
    assert (await edge.exec(sid, ExecRequest(cmd="true"))).exit_code == 0
    assert (await edge.get(sid)).state == SandboxState.running

    # ended: its record answers, nothing else does
    await edge.stop(sid)
    assert sid not in edge.sandboxes and (await edge.get(sid)).state == SandboxState.stopped
    assert (await edge.resume(sid)).state == SandboxState.stopped
    with pytest.raises(SandboxNotRunning, match=f"sandbox {sid} is stopped"):
        await edge.exec(sid, ExecRequest(cmd="true"))
    with pytest.raises(SandboxNotRunning, match=f"sandbox {sid} is stopped"):
        await edge.pause(sid)
    with pytest.raises(SandboxNotRunning, match="nothing to checkpoint"):
        await edge.checkpoint(sid)
    with pytest.raises(SandboxNotRunning, match="has ended"):
        await edge.set_deadline(sid, 10)
    with pytest.raises(SandboxNotRunning, match="it uses nothing"):
        await edge.usage(sid)
    assert await edge.command_log(sid) == [] and (await edge.stop(sid)).state == SandboxState.stopped

    # an id this edge never had, and one that is no id
    never = f"{edge.name}-aaaaaaaaaaaa"
    with pytest.raises(NotFound):
        await edge.exec(never, ExecRequest(cmd="true"))
    with pytest.raises(NotFound):
        await edge.get(never)
    with pytest.raises(InvalidRequest) as e:
        await edge.stop("not an id")
    assert e.value.field == "sandbox_id"


async def test_a_stopping_sandbox_refuses_requests(edge: Edge) -> None:
    sid = (await edge.create(ContainerArgs(image="base/busybox"))).sandbox_id
    sb = edge.sandboxes[sid]
    sb.stopping = True  # what a teardown under way sets first
    try:
        assert state_of(sb) == State.STOPPING
        with pytest.raises(SandboxNotRunning):
            await edge.exec(sid, ExecRequest(cmd="true"))
        with pytest.raises(SandboxNotRunning, match="has ended"):
            await edge.set_deadline(sid, 10)
        assert (await edge.usage(sid)).cpu_s >= 0  # it still holds what it used
    finally:
        sb.stopping = False
    await edge.stop(sid)
    assert sid not in edge.sandboxes


async def test_transitions_through_the_embedded_edge(client: dsec.AsyncClient) -> None:
    sb = await client.run_container(dsec.ContainerArgs(image="base/busybox"))
    try:
        await sb.pause()
        assert (await sb.refresh()).state == dsec.SandboxState.paused
        r = await sb.exec("echo resumed")  # any request resumes a paused sandbox
        assert r.exit_code == 0 and r.stdout == "resumed\n"
        assert (await sb.refresh()).state == dsec.SandboxState.running
    finally:
        await sb.stop()
    with pytest.raises(dsec.DsecError):
        await sb.exec("true")
