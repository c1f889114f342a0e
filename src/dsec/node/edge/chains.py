"""Where each sandbox's checkpoints stand on this edge: its chain (the newest checkpoint's
seq and stack, deltas since the last full), kept in a file beside its manifest; the
checkpoints under way and the build slots; and forgetting a sandbox's checkpoints at its
end (dsec.node.edge.teardown). Taking and restoring them is dsec.node.edge.checkpointing's."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from dataclasses import dataclass, field

from dsec.node.checkpoints import delta
from dsec.node.checkpoints.store import CheckpointStore, had_checkpoints
from dsec.node.edge.core import EdgeNode
from dsec.node.edge.sandbox import Sandbox
from dsec.shared.wire.fleet import CheckpointInfo

log = logging.getLogger("dsec.edge")
BUILDS_AT_ONCE = 2  # mkfs.erofs is CPU-bound: the edge builds this many checkpoints at a time


@dataclass
class Chain:
    """Where a sandbox's checkpoints stand on this edge (kept beside its manifest)."""

    seq: int = 0  # the newest checkpoint's
    stack: list[str] = field(default_factory=list)  # its complete stack
    inherited: list[str] = field(default_factory=list)  # what it was restored from (under every full)
    deltas: int = 0  # deltas since the last full (-1: none taken here yet, the next is full)
    commands_seq: int = 0  # the command log's newest seq in that checkpoint
    taken_at: float = 0.0


class CheckpointChains:
    """The chains and the checkpoints under way of this edge's sandboxes."""

    def __init__(self, node: EdgeNode, store: CheckpointStore) -> None:
        self.node = node
        self.store = store
        self.chains: dict[str, Chain] = {}
        self.tasks: dict[str, asyncio.Task[CheckpointInfo | None]] = {}  # scheduled ones under way
        self.locks: dict[str, asyncio.Lock] = {}  # one checkpoint of a sandbox at a time (each its own seq)
        self.builds = asyncio.Semaphore(BUILDS_AT_ONCE)
        volume = node.volume
        self.ckpt_dir = os.path.join(volume.mnt if volume.available else node.root, "checkpoints")
        self.manifest_dir = os.path.join(self.node.root, "manifests")
        os.makedirs(self.manifest_dir, exist_ok=True)
        if os.path.isdir(self.ckpt_dir):  # snapshots a previous process left half-used
            for name in os.listdir(self.ckpt_dir):
                volume.remove(os.path.join(self.ckpt_dir, name))
        os.makedirs(self.ckpt_dir, exist_ok=True)

    # ---- the chain's state on this edge ----------------------------------------------
    def path(self, sandbox_id: str) -> str:
        return os.path.join(self.manifest_dir, f"{sandbox_id}.json")

    def read(self, sb: Sandbox) -> tuple[Chain, delta.Manifest]:
        """The chain as of the newest checkpoint, from its file; a missing or stale file
        (a checkpoint recorded after it) starts a full one."""
        chain, manifest = self.chains.get(sb.id), None
        path = self.path(sb.id)
        try:
            with open(path) as f:
                raw = json.load(f)
            manifest = {k: tuple(v) for k, v in raw.pop("manifest").items()}
            chain = Chain(**raw)
        except (OSError, ValueError, TypeError, KeyError):
            chain = chain or Chain(deltas=-1)
        latest = self.store.latest(sb.id)
        if latest is not None and latest.seq != chain.seq:  # recorded elsewhere or after the file
            chain = Chain(seq=latest.seq, stack=latest.stack, inherited=chain.inherited, deltas=-1)
            manifest = None
        return chain, manifest or {}  # type: ignore[return-value]

    def save(self, sandbox_id: str, chain: Chain, manifest: delta.Manifest) -> None:
        path = self.path(sandbox_id)
        with open(path + ".tmp", "w") as f:
            json.dump({**chain.__dict__, "manifest": manifest}, f, separators=(",", ":"))
        os.replace(path + ".tmp", path)
        self.chains[sandbox_id] = chain

    def forget(self, sb: Sandbox, keep: bool) -> None:
        """At the end of ``sb`` here: its chain file goes; its checkpoints too unless it
        moved (or its restore here failed: the checkpoint is still the sandbox)."""
        task = self.tasks.pop(sb.id, None)
        if task is not None and not task.done():
            task.cancel()
        self.chains.pop(sb.id, None)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path(sb.id))
        # (a checkpoint ever begun here has a lock: it may have committed its row already)
        begun = self.locks.pop(sb.id, None) is not None
        if not keep and (task is not None or begun or had_checkpoints(sb.rec.info)):
            try:  # fenced: a stale copy ending here leaves the holder's checkpoints alone
                self.store.drop_sandbox(sb.id, holder=self.node.name)
            except Exception as e:  # the database is away: the apiserver's stop drops them too
                log.warning("sandbox %s: checkpoints not dropped: %s", sb.id, e)

