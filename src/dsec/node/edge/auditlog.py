"""The audit log of what happened in sandboxes, and detectors of known reward-hacking moves.

Records live outside every sandbox (SQLite in the edge's data dir), are bounded per
sandbox (oldest dropped past ``PER_SANDBOX``) and in length (``MAX_DETAIL``), and outlive
the sandbox for ``MAX_AGE_S``. What is recorded: every process a sandbox executes (from the
kernel's process-event connector, see :mod:`dsec.node.edge.procwatch`), every request the
platform served into it (exec, file writes and removals, HTTP, TTY), and every egress
denial. Detectors add a ``flag`` to the record that tripped them and raise a sandbox event:

- ``protected_path``: a file under a path the owner protected changed, appeared or went.
- ``platform_probe``: a command reaching for the platform (dsec-init's /proc/1 entries, the
  agent's runtime dirs, masked kernel interfaces).
- ``egress_burst``: many denied connections in a short time (scanning for a way out).
- ``replaced_binary``: a system binary or library of the image was overwritten.
"""

from __future__ import annotations

import collections
import hashlib
import os
import re
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from dsec.shared.wire.models import AuditRecord

PER_SANDBOX = 20_000
MAX_DETAIL = 4096
MAX_AGE_S = 7 * 86400
BURST_DENIALS, BURST_WINDOW_S = 20, 60.0
SYSTEM_DIRS = ("bin", "sbin", "usr/bin", "usr/sbin", "lib", "lib64", "usr/lib", "usr/lib64", "usr/libexec")
PROBE = re.compile(r"/proc/1/(root|fd|environ|mem|maps|cwd|exe)|/run/dsec|dsec-init|/proc/kcore|/proc/kpage|"
                   r"/proc/sysrq-trigger|/sys/kernel/debug|/proc/\d+/root/")
PROTECT_MAX_FILES = 5000
PROTECT_MAX_BYTES = 64 << 20


class AuditLog:
    def __init__(self, path: str) -> None:
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("CREATE TABLE IF NOT EXISTS audit (seq INTEGER PRIMARY KEY AUTOINCREMENT, sandbox TEXT,"
                         " ts REAL, kind TEXT, detail TEXT, flag TEXT)")
        self._db.execute("CREATE INDEX IF NOT EXISTS audit_sb ON audit (sandbox, seq)")
        self._pending: list[tuple[str, float, str, str, str | None]] = []
        self._lock = threading.Lock()
        self._counts: collections.Counter[str] = collections.Counter()

    def record(self, sandbox_id: str, kind: str, detail: str, flag: str | None = None) -> None:
        """Buffered; written by ``flush`` (the edge's sweep, and before every query)."""
        with self._lock:
            self._pending.append((sandbox_id, time.time(), kind, detail[:MAX_DETAIL], flag))

    def flush(self) -> None:
        with self._lock:
            rows, self._pending = self._pending, []
        if not rows:
            return
        with self._db:
            self._db.executemany("INSERT INTO audit (sandbox, ts, kind, detail, flag) VALUES (?,?,?,?,?)", rows)
        self._counts.update(r[0] for r in rows)
        for sid in {r[0] for r in rows}:
            if self._counts[sid] > PER_SANDBOX * 1.1:  # amortised: trim once 10% over
                self._db.execute("DELETE FROM audit WHERE sandbox=? AND seq <= (SELECT seq FROM audit WHERE "
                                 "sandbox=? ORDER BY seq DESC LIMIT 1 OFFSET ?)", (sid, sid, PER_SANDBOX))
                self._counts[sid] = PER_SANDBOX

    def prune(self) -> None:
        self._db.execute("DELETE FROM audit WHERE ts < ?", (time.time() - MAX_AGE_S,))

    def query(self, sandbox_id: str, kind: str | None = None, flagged: bool = False,
              limit: int = 1000) -> list[AuditRecord]:
        self.flush()
        sql = "SELECT ts, kind, detail, flag FROM audit WHERE sandbox=?"
        params: list[object] = [sandbox_id]
        if kind:
            sql += " AND kind=?"
            params.append(kind)
        if flagged:
            sql += " AND flag IS NOT NULL"
        sql += " ORDER BY seq DESC LIMIT ?"
        params.append(limit)
        rows = self._db.execute(sql, params).fetchall()
        return [AuditRecord(ts=r[0], kind=r[1], detail=r[2], flag=r[3]) for r in reversed(rows)]

    def close(self) -> None:
        self.flush()
        self._db.close()


@dataclass
class _Watch:
    denials: collections.deque[float] = field(default_factory=lambda: collections.deque(maxlen=BURST_DENIALS))
    burst_at: float = 0.0
    protected: dict[str, tuple[int, int, int, str]] = field(default_factory=dict)  # path -> size, mtime, ctime, sha
    protected_roots: list[str] = field(default_factory=list)
    flagged: set[str] = field(default_factory=set)


FileTree = Callable[[str], "list[tuple[str, int, int, int]]"]  # root -> (path, size, mtime_ns, ctime_ns) files
ReadFile = Callable[[str], bytes]


class Detectors:
    """Per-sandbox detector state; ``flag`` is called with (sandbox, detector, message)."""

    def __init__(self, flag: Callable[[str, str, str], None]) -> None:
        self.flag = flag
        self.watch: dict[str, _Watch] = collections.defaultdict(_Watch)

    def forget(self, sandbox_id: str) -> None:
        self.watch.pop(sandbox_id, None)

    def command(self, sandbox_id: str, cmdline: str) -> str | None:
        m = PROBE.search(cmdline)
        if m:
            self.flag(sandbox_id, "platform_probe", f"command reaches for {m.group(0)!r}: {cmdline[:200]}")
            return "platform_probe"
        return None

    def denial(self, sandbox_id: str) -> str | None:
        w = self.watch[sandbox_id]
        now = time.monotonic()
        w.denials.append(now)
        if len(w.denials) == BURST_DENIALS and now - w.denials[0] < BURST_WINDOW_S and now - w.burst_at > 60:
            w.burst_at = now
            self.flag(sandbox_id, "egress_burst", f"{BURST_DENIALS} denied connections in {now - w.denials[0]:.0f} s")
            return "egress_burst"
        return None

    # ---- protected paths -----------------------------------------------------
    def protect(self, sandbox_id: str, roots: list[str], tree: FileTree, read: ReadFile) -> int:
        """Remember the files under ``roots`` as they are now; returns how many."""
        w = self.watch[sandbox_id]
        for root in roots:
            if root not in w.protected_roots:
                w.protected_roots.append(root)
        snap: dict[str, tuple[int, int, int, str]] = {}
        total = 0
        for root in w.protected_roots:
            for path, size, mtime, ctime in tree(root):
                total += size
                if len(snap) >= PROTECT_MAX_FILES or total > PROTECT_MAX_BYTES:
                    raise ValueError(f"protected paths hold more than {PROTECT_MAX_FILES} files or "
                                     f"{PROTECT_MAX_BYTES >> 20} MiB")
                snap[path] = (size, mtime, ctime, hashlib.sha256(read(path)).hexdigest())
        w.protected = snap
        w.flagged.clear()
        return len(snap)

    def check_protected(self, sandbox_id: str, tree: FileTree, read: ReadFile) -> list[str]:
        """Changes under the protected roots since ``protect``: a file is re-hashed only when
        its size, mtime or ctime moved (ctime cannot be set from user space)."""
        w = self.watch.get(sandbox_id)
        if w is None or not w.protected_roots:
            return []
        now: dict[str, tuple[int, int, int]] = {}
        for root in w.protected_roots:
            for path, size, mtime, ctime in tree(root):
                now[path] = (size, mtime, ctime)
        changes = []
        for path, (size, mtime, ctime, sha) in w.protected.items():
            cur = now.get(path)
            if cur is None:
                changes.append(f"removed {path}")
            elif cur != (size, mtime, ctime):
                try:
                    if hashlib.sha256(read(path)).hexdigest() != sha:
                        changes.append(f"changed {path}")
                except OSError:
                    changes.append(f"unreadable {path}")
        changes += [f"added {p}" for p in now if p not in w.protected]
        fresh = [c for c in changes if c not in w.flagged]
        for c in fresh:
            w.flagged.add(c)
            self.flag(sandbox_id, "protected_path", c)
        return changes

    # ---- replaced system files ---------------------------------------------------
    def check_replaced(self, sandbox_id: str, upper: str, lowers: list[str]) -> list[str]:
        """Image files under the system dirs that the sandbox overwrote (present in its
        writable layer and in a layer below). Walks names only, never following links."""
        w = self.watch[sandbox_id]
        found = []
        for sub in SYSTEM_DIRS:
            top = os.path.join(upper, sub)
            if os.path.islink(top) or not os.path.isdir(top):
                continue
            for dirpath, _dirs, files in os.walk(top):
                for name in files:
                    rel = os.path.relpath(os.path.join(dirpath, name), upper)
                    if any(os.path.lexists(os.path.join(lower, rel)) for lower in lowers):
                        found.append("/" + rel)
                if len(found) > 100:
                    break
        for path in found:
            key = f"replaced {path}"
            if key not in w.flagged:
                w.flagged.add(key)
                self.flag(sandbox_id, "replaced_binary", f"image file overwritten: {path}")
        return found
