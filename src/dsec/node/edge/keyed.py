"""Keyed exec: a command sent with a key is recorded in the sandbox's command log
(:mod:`dsec.node.edge.cmdlog`); the same key again returns the record and runs nothing, a
caller with the key of a command still running waits for it, and the same key with a
different command is refused (docs/rl.md, "Command log and fast-forward")."""

from __future__ import annotations

import asyncio

from dsec.node.agent.aether import Aether, OnData
from dsec.node.edge.cmdlog import (
    INTERRUPTED,
    MAX_BYTES,
    MAX_RECORDS,
    WAIT_MARGIN_S,
    CommandLog,
    InFlight,
    Relay,
    fingerprint,
    interrupted,
    replay,
)
from dsec.node.edge.lifecycle import Lifecycle, Op
from dsec.node.edge.runner import CommandRunner
from dsec.node.edge.sandbox import Sandbox, explain
from dsec.node.edge.table import SandboxTable
from dsec.shared.errors import CommandForgotten, DeadlineExceeded, DsecError, KeyConflict
from dsec.shared.wire.models import CommandRecord, ExecRequest, ExecResult


class KeyedExec:
    """exec with a key: recorded, replayed, waited for, refused on a different command."""

    def __init__(self, table: SandboxTable, lifecycle: Lifecycle, runner: CommandRunner, cmdlog: CommandLog) -> None:
        self.table = table
        self.lifecycle = lifecycle
        self.runner = runner
        self.cmdlog = cmdlog

    async def exec(self, sandbox_id: str, req: ExecRequest, on_data: OnData | None) -> ExecResult:
        assert req.key is not None
        fp = fingerprint(req)
        self.lifecycle.check(Op.COMMAND_LOG, sandbox_id)  # validates the id and its edge (records answer in any state)
        # a recorded key answers even from a paused or ended sandbox: nothing needs to run
        recorded = await self._recorded(sandbox_id, req, fp, on_data)
        if recorded is not None:
            return recorded
        sb, agent = await self.lifecycle.ready(Op.EXEC, sandbox_id)
        recorded = await self._recorded(sandbox_id, req, fp, on_data)  # _ready may have waited
        if recorded is not None:
            return recorded
        # from the lookup to here nothing awaits: one run per key, however many callers race
        self.cmdlog.begin(sb.id, req.key, fp, req)
        relay = Relay(on_data)
        task = asyncio.create_task(self._record(sb, agent, req, relay))
        self.cmdlog.inflight[(sb.id, req.key)] = InFlight(fp, task)
        try:  # the caller going away does not end the command: a retry with its key waits for it
            return await asyncio.shield(task)
        finally:
            relay.target = None

    async def _recorded(self, sandbox_id: str, req: ExecRequest, fp: str, on_data: OnData | None
                        ) -> ExecResult | None:
        key = req.key
        assert key is not None
        running = self.cmdlog.inflight.get((sandbox_id, key))
        if running is not None:
            self._same(sandbox_id, key, fp, running.fingerprint)
            try:
                async with asyncio.timeout(req.timeout_s + WAIT_MARGIN_S):
                    return replay(await asyncio.shield(running.task), on_data)
            except TimeoutError:
                raise DeadlineExceeded(f"the command with key {key!r} is still running (started by an earlier "
                                       "call); ask again to go on waiting", field="key", sandbox_id=sandbox_id,
                                       operation="exec") from None
        entry = self.cmdlog.get(sandbox_id, key)
        if entry is None:
            return None
        self._same(sandbox_id, key, fp, entry.fingerprint)
        if entry.state == "dropped":
            raise CommandForgotten(f"the record of key {key!r} was dropped (past the command log's bound of "
                                   f"{MAX_RECORDS} records or {MAX_BYTES >> 20} MiB per sandbox); it is not run "
                                   "again", field="key", sandbox_id=sandbox_id, operation="exec")
        # a record left running with no run in flight: its result was never written
        return replay(entry.result or interrupted(INTERRUPTED), on_data)

    @staticmethod
    def _same(sandbox_id: str, key: str, fp: str, recorded: str) -> None:
        if fp != recorded:
            raise KeyConflict(f"key {key!r} already names a different command in this sandbox (the same key must "
                              "carry the same cmd or argv, session, env, cwd and stdin)", field="key",
                              sandbox_id=sandbox_id, operation="exec")

    async def _record(self, sb: Sandbox, agent: Aether, req: ExecRequest, relay: Relay) -> ExecResult:
        key = req.key
        assert key is not None
        try:
            res = await self.runner.run(sb, agent, req, relay)
        except DsecError as e:
            if e.infra:  # it may have run in part: never again
                self.cmdlog.interrupt(sb.id, key, f"dsec: the platform failed under this command: {e.message}")
            else:  # refused: nothing ran
                self.cmdlog.discard(sb.id, key)
            raise
        except asyncio.CancelledError:
            raise  # the edge is closing: the record stays running, and its next start marks it interrupted
        except Exception as e:
            self.cmdlog.interrupt(sb.id, key, f"dsec: the platform failed under this command: {explain(e)}")
            raise
        finally:
            self.cmdlog.inflight.pop((sb.id, key), None)
        self.cmdlog.finish(sb.id, key, res)
        return res

    async def command_log(self, sandbox_id: str, after: int = 0, limit: int = 1000) -> list[CommandRecord]:
        if self.lifecycle.check(Op.COMMAND_LOG, sandbox_id) is None:
            self.table.tombstone(sandbox_id)  # NotFound for a sandbox this edge never had
        return self.cmdlog.list(sandbox_id, after, max(1, min(limit, MAX_RECORDS)))

    async def close(self) -> None:
        """Keyed commands in flight end with the edge (their records say interrupted next start)."""
        tasks = [f.task for f in self.cmdlog.inflight.values()]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=10)
        self.cmdlog.close()
