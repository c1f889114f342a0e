"""Layers made from a sandbox: pack_diff (its writes as a workspace or toolkit layer,
scrubbed of build residue) and the access lists of sandboxes that record what they read."""

from __future__ import annotations

import asyncio
import os

from dsec.node.edge.accesslists import AccessLists
from dsec.node.edge.core import EdgeNode
from dsec.node.edge.lifecycle import Lifecycle, Op
from dsec.node.layers.store import ImportOptions, Layer, layer_kind
from dsec.shared.errors import InvalidRequest
from dsec.shared.faults import failpoint
from dsec.shared.wire.models import ContainerArgs

# build residue that pack_diff leaves out unless told otherwise (regexes on paths
# relative to the sandbox root)
DEFAULT_SCRUB = [
    r"^tmp/.+", r"^var/tmp/.+", r"^root/\.(bash|python|sh|ash)_history$", r"^root/\.(lesshst|viminfo|wget-hsts)$",
    r"^root/\.cache/.+", r"^var/cache/apt/.+", r"^var/lib/apt/lists/.+", r"^var/log/.+",
]


def scrub_regexes(paths: list[str], defaults: bool) -> list[str]:
    """Regexes for mkfs.erofs --exclude-regex: the defaults plus each absolute path
    given (the path itself and everything below it)."""
    import re

    out = list(DEFAULT_SCRUB) if defaults else []
    for p in paths:
        if not p.startswith("/") or p == "/":
            raise InvalidRequest(f"scrub path {p!r} must be absolute and not /", field="scrub_paths")
        out.append(f"^{re.escape(os.path.normpath(p).lstrip('/'))}(/.*)?$")
    return out

class Snapshots:
    """pack_diff and the access lists asked for."""

    def __init__(self, node: EdgeNode, lifecycle: Lifecycle, access: AccessLists) -> None:
        self.node = node
        self.lifecycle = lifecycle
        self.access = access

    async def pack_diff(self, sandbox_id: str, ref: str, scrub_paths: list[str] | None = None,
                        default_scrub: bool = True, source: str | None = None) -> Layer:
        """Publish the sandbox's writes (its overlay upper dir: new and changed files,
        whiteouts for deletions, opaque dirs) as workspace layer ``ref``, incremental
        over the stack it runs on. The sandbox is frozen while the image is built."""
        sb, _ = await self.lifecycle.ready(Op.PACK_DIFF, sandbox_id)
        if (upper := self.node.backend_of(sb).writable_dir(sb)) is None:
            raise InvalidRequest("pack_diff works on container sandboxes; a VM's writes are on its own ext4 disk",
                                 field="sandbox_id")
        try:
            kind = layer_kind(ref)
        except InvalidRequest as e:
            raise InvalidRequest(e.message, field="ref") from None
        if kind == "base":
            raise InvalidRequest(f"pack_diff makes workspace (ws/...) or toolkit (tk/...) layers, not {ref!r}",
                                 field="ref")
        if self.node.layers.has(ref):
            raise InvalidRequest(f"layer {ref!r} already exists; layers are immutable", field="ref")
        opts = ImportOptions(exclude_regex=scrub_regexes(scrub_paths or [], default_scrub))
        async with sb.lock:
            await self.node.containers.freeze(sb)
            try:
                await failpoint("pack_diff.frozen")
                layer = await asyncio.to_thread(
                    self.node.layers.import_dir, upper, ref, kind, opts,
                    sb.rec.args.image, sb.rec.args.layers, source or f"pack_diff of {sb.id}")
                await failpoint("pack_diff.built")
            finally:
                await self.node.containers.thaw(sb)
        self.node.on_event(sb.id, "pack_diff", f"{layer.ref} {layer.digest[:12]} {layer.size} bytes")
        return layer

    async def save_access_lists(self, sandbox_id: str) -> dict[str, int]:
        """Save what a ``record_access`` sandbox read so far as its layers' access lists."""
        sb, _ = self.lifecycle.attached(Op.SAVE_ACCESS_LISTS, sandbox_id)
        if not isinstance(sb.rec.args, ContainerArgs) or not sb.rec.args.record_access:
            raise InvalidRequest(f"sandbox {sandbox_id} was not created with record_access", field="record_access")
        return await self.access.save(sb)
