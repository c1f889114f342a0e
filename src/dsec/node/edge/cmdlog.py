"""The command log: the keyed commands a sandbox ran and their results, so a client that
sends a key again (a trainer restarted after a preemption) gets the recorded result
instead of running the command twice (docs/rl.md, "Command log and fast-forward").

Records live outside every sandbox, in SQLite in the edge's data dir next to its sandbox
records, so they outlive an edge restart and the apiserver stays stateless. A command the
edge was running when it went down is recorded as interrupted (its outcome is unknown):
a retry returns that record and never runs it again.

Bounded per sandbox, because the output recorded is the sandbox's (hostile) output:
``MAX_RECORDS`` records and ``MAX_BYTES`` of results, the oldest finished records dropped
first; each stream of a record capped at ``RECORD_OUTPUT_BYTES``; a dropped record's key
is remembered (up to ``MAX_FORGOTTEN`` of them) so that it answers 410, not a second run.
Records of an ended sandbox go with its tombstone.
"""

from __future__ import annotations

import asyncio
import builtins
import hashlib
import json
import os
import time
from dataclasses import dataclass

from dsec.node.agent.interfaces import OnData
from dsec.node.edge.state import TOMBSTONE_TTL_S, open_local_db
from dsec.shared.wire.models import CommandRecord, ExecRequest, ExecResult

# the record bound is an environment setting only so that tests can reach it quickly
MAX_RECORDS = int(os.environ.get("DSEC_COMMAND_LOG_RECORDS", "10000"))
MAX_BYTES = 32 << 20
RECORD_OUTPUT_BYTES = 32 << 10
MAX_FORGOTTEN = 100_000
WAIT_MARGIN_S = 5.0  # a caller waiting on the same key's run waits its own timeout plus this
INTERRUPTED = "dsec: the edge restarted while this command ran; its outcome is unknown and it was not run again"


def fingerprint(req: ExecRequest) -> str:
    """What makes two requests "the same command": cmd or argv, session, env, cwd, stdin and
    the user. The timeout and the output limit do not count: a retry may choose other ones,
    and gets the recorded result as it was."""
    ident: list[object] = [req.cmd, req.argv, req.session, sorted(req.env.items()), req.cwd, req.stdin]
    if req.uid is not None:  # only then: records made before users existed keep their fingerprints
        ident += [req.uid, req.gid]
    return hashlib.sha256(json.dumps(ident, separators=(",", ":")).encode()).hexdigest()[:32]


def _cap(text: str) -> tuple[str, bool]:
    if len(text) <= RECORD_OUTPUT_BYTES // 4:  # no character is wider than 4 bytes
        return text, False
    data = text.encode()
    if len(data) <= RECORD_OUTPUT_BYTES:
        return text, False
    return data[:RECORD_OUTPUT_BYTES].decode(errors="ignore"), True


def capped(res: ExecResult) -> ExecResult:
    out, out_cut = _cap(res.stdout)
    err, err_cut = _cap(res.stderr)
    return res.model_copy(update={"stdout": out, "stderr": err, "stdout_truncated": res.stdout_truncated or out_cut,
                                  "stderr_truncated": res.stderr_truncated or err_cut})


@dataclass
class Entry:
    fingerprint: str
    state: str  # running, done, interrupted, dropped
    result: ExecResult | None


@dataclass
class _Counts:
    kept: int  # records not dropped
    bytes: int  # of their results
    forgotten: int  # dropped records whose key is remembered
    seq: int  # the last record's


@dataclass
class InFlight:
    fingerprint: str
    task: asyncio.Task[ExecResult]


@dataclass
class Relay:
    """The first caller's output callback, cut off when that caller goes away (the keyed
    command goes on: another caller with its key waits for its result)."""

    target: OnData | None

    def __call__(self, name: str, data: bytes) -> None:
        if self.target is not None:
            self.target(name, data)


class CommandLog:
    """The store (SQLite, used from the event loop: every statement is one small indexed
    row) and the commands in flight by key."""

    def __init__(self, path: str) -> None:
        self._db = open_local_db(path)
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS commands (sandbox TEXT NOT NULL, key TEXT NOT NULL, seq INTEGER NOT NULL,"
            " fingerprint TEXT NOT NULL, state TEXT NOT NULL, request TEXT, result TEXT, bytes INTEGER NOT NULL,"
            " started_at REAL NOT NULL, finished_at REAL, PRIMARY KEY (sandbox, key))")
        self._db.execute("CREATE INDEX IF NOT EXISTS commands_seq ON commands (sandbox, seq)")
        self._db.execute("CREATE TABLE IF NOT EXISTS ended (sandbox TEXT PRIMARY KEY, at REAL NOT NULL)")
        self._counts: dict[str, _Counts] = {}
        self.inflight: dict[tuple[str, str], InFlight] = {}
        self._swept = 0.0

    def close(self) -> None:
        self._db.close()

    def get(self, sandbox_id: str, key: str) -> Entry | None:
        row = self._db.execute("SELECT fingerprint, state, result FROM commands WHERE sandbox=? AND key=?",
                               (sandbox_id, key)).fetchone()
        if row is None:
            return None
        return Entry(row[0], row[1], ExecResult.model_validate_json(row[2]) if row[2] else None)

    def begin(self, sandbox_id: str, key: str, fp: str, req: ExecRequest) -> None:
        c = self._counts_of(sandbox_id)
        c.seq += 1
        c.kept += 1
        request = json.dumps({"cmd": req.cmd, "argv": req.argv, "session": req.session, "cwd": req.cwd})
        self._db.execute("INSERT OR REPLACE INTO commands VALUES (?,?,?,?,'running',?,NULL,0,?,NULL)",
                         (sandbox_id, key, c.seq, fp, request, time.time()))
        self._bound(sandbox_id, c)

    def finish(self, sandbox_id: str, key: str, res: ExecResult, state: str = "done") -> None:
        data = capped(res).model_dump_json()
        c = self._counts_of(sandbox_id)
        cur = self._db.execute("UPDATE commands SET state=?, result=?, bytes=?, finished_at=? WHERE sandbox=? AND"
                               " key=? AND state='running'", (state, data, len(data), time.time(), sandbox_id, key))
        if cur.rowcount:
            c.bytes += len(data)
            self._bound(sandbox_id, c)

    def interrupt(self, sandbox_id: str, key: str, why: str) -> None:
        self.finish(sandbox_id, key, interrupted(why), "interrupted")

    def discard(self, sandbox_id: str, key: str) -> None:
        """Forget a command that never ran (the request was refused)."""
        if self._db.execute("DELETE FROM commands WHERE sandbox=? AND key=? AND state='running'",
                            (sandbox_id, key)).rowcount:
            self._counts_of(sandbox_id).kept -= 1

    def interrupt_all(self) -> int:
        """At the edge's start: whatever was running when it went down ended unseen."""
        data = interrupted(INTERRUPTED).model_dump_json()
        n = self._db.execute("UPDATE commands SET state='interrupted', result=?, bytes=?, finished_at=? WHERE "
                             "state='running'", (data, len(data), time.time())).rowcount
        self._counts.clear()
        return n

    def list(self, sandbox_id: str, after: int = 0, limit: int = 1000) -> list[CommandRecord]:
        rows = self._db.execute(
            "SELECT key, seq, request, state, started_at, finished_at, result FROM commands WHERE sandbox=? AND"
            " seq>? AND state!='dropped' ORDER BY seq LIMIT ?", (sandbox_id, after, limit))
        out = []
        for key, seq, request, state, started, finished, result in rows:
            out.append(CommandRecord(key=key, seq=seq, state=state, started_at=started, finished_at=finished,
                                     result=ExecResult.model_validate_json(result) if result else None,
                                     **json.loads(request)))
        return out

    COLUMNS = ("key", "seq", "fingerprint", "state", "request", "result", "bytes", "started_at", "finished_at")

    def export(self, sandbox_id: str) -> builtins.list[dict[str, object]]:
        """The sandbox's records as rows, oldest first (what a checkpoint carries)."""
        rows = self._db.execute(f"SELECT {', '.join(self.COLUMNS)} FROM commands WHERE sandbox=? AND "
                                "state!='running' ORDER BY seq", (sandbox_id,))
        return [dict(zip(self.COLUMNS, r, strict=True)) for r in rows]

    def restore(self, sandbox_id: str, rows: builtins.list[dict[str, object]]) -> int:
        """Take ``rows`` (an export) back as the sandbox's records; keys it has already win."""
        sql = (f"INSERT OR IGNORE INTO commands (sandbox, {', '.join(self.COLUMNS)}) "
               f"VALUES (?{',?' * len(self.COLUMNS)})")
        with self._db:
            n = sum(self._db.execute(sql, (sandbox_id, *(r.get(c) for c in self.COLUMNS))).rowcount for r in rows)
        self._counts.pop(sandbox_id, None)
        return n

    def last_seq(self, sandbox_id: str) -> int:
        return self._counts_of(sandbox_id).seq

    def roll_back(self, sandbox_id: str, seq: int, at: float) -> int:
        """The sandbox went back to its state at time ``at``, when ``seq`` was its last
        record: drop every record that had not finished by then (later commands, and any
        that ran across that instant), so their keys run again. How many were dropped."""
        n = self._db.execute("DELETE FROM commands WHERE sandbox=? AND (seq>? OR finished_at IS NULL OR finished_at>?)",
                             (sandbox_id, seq, at)).rowcount
        self._counts.pop(sandbox_id, None)  # recounted from the rows left (seq goes on from the last kept)
        return int(n)

    def sweep(self, live: set[str]) -> None:
        """Every minute at most: note the sandboxes that ended, and drop the records of those
        that ended longer ago than a sandbox's tombstone lasts."""
        now = time.time()
        if now - self._swept < 60:
            return
        self._swept = now
        known = {r[0] for r in self._db.execute("SELECT DISTINCT sandbox FROM commands")}
        ended = {r[0] for r in self._db.execute("SELECT sandbox FROM ended")}
        with self._db:
            self._db.executemany("INSERT OR IGNORE INTO ended VALUES (?,?)",
                                 [(sid, now) for sid in known - live - ended])
            self._db.executemany("DELETE FROM ended WHERE sandbox=?", [(sid,) for sid in ended & live])
            gone = [r[0] for r in self._db.execute("SELECT sandbox FROM ended WHERE at < ?",
                                                   (now - TOMBSTONE_TTL_S,))]
            for sid in gone:
                self._db.execute("DELETE FROM commands WHERE sandbox=?", (sid,))
                self._db.execute("DELETE FROM ended WHERE sandbox=?", (sid,))
                self._counts.pop(sid, None)

    def _counts_of(self, sandbox_id: str) -> _Counts:
        c = self._counts.get(sandbox_id)
        if c is None:
            kept, size, forgotten, seq = self._db.execute(
                "SELECT COALESCE(SUM(state!='dropped'),0), COALESCE(SUM(bytes),0), COALESCE(SUM(state='dropped'),0),"
                " COALESCE(MAX(seq),0) FROM commands WHERE sandbox=?", (sandbox_id,)).fetchone()
            c = self._counts[sandbox_id] = _Counts(int(kept), int(size), int(forgotten), int(seq))
        return c

    def _bound(self, sandbox_id: str, c: _Counts) -> None:
        """Drop the oldest finished records past the bounds, keeping their keys (as
        forgotten); forget the oldest of those past theirs."""
        if c.kept > MAX_RECORDS or c.bytes > MAX_BYTES:
            drop = []
            for key, size in self._db.execute("SELECT key, bytes FROM commands WHERE sandbox=? AND state IN "
                                              "('done','interrupted') ORDER BY seq", (sandbox_id,)):
                if c.kept <= MAX_RECORDS and c.bytes <= MAX_BYTES:
                    break
                drop.append((sandbox_id, key))
                c.kept, c.bytes, c.forgotten = c.kept - 1, c.bytes - size, c.forgotten + 1
            with self._db:
                self._db.executemany("UPDATE commands SET state='dropped', request=NULL, result=NULL, bytes=0 "
                                     "WHERE sandbox=? AND key=?", drop)
        if c.forgotten > MAX_FORGOTTEN:
            n = c.forgotten - MAX_FORGOTTEN
            self._db.execute("DELETE FROM commands WHERE rowid IN (SELECT rowid FROM commands WHERE sandbox=? AND "
                             "state='dropped' ORDER BY seq LIMIT ?)", (sandbox_id, n))
            c.forgotten -= n


def interrupted(why: str) -> ExecResult:
    return ExecResult(exit_code=-1, stdout="", stderr=why, failure="infra")


def replay(res: ExecResult, on_data: OnData | None) -> ExecResult:
    """A recorded result for a call that ran nothing; a stream gets its output as events first."""
    if on_data is not None:
        if res.stdout:
            on_data("stdout", res.stdout.encode())
        if res.stderr:
            on_data("stderr", res.stderr.encode())
    return res.model_copy(update={"replayed": True})
