"""The access lists of sandboxes that record what they read (``record_access``): what a
sandbox read of each of its layers' blobs, saved as that blob's access list (the chunks a
node fetches first for the next sandbox over it). Saved on request (dsec.node.edge.snapshots)
and at the sandbox's end (dsec.node.edge.teardown)."""

from __future__ import annotations

import logging

from dsec.node.edge.core import EdgeNode
from dsec.node.edge.sandbox import Sandbox

log = logging.getLogger("dsec.edge")


class AccessLists:
    """Saving a sandbox's access lists into the layer store."""

    def __init__(self, node: EdgeNode) -> None:
        self.node = node

    async def save(self, sb: Sandbox, forget: bool = False) -> dict[str, int]:
        saved: dict[str, int] = {}
        for d in sb.rec.digests:
            try:
                got = await self.node.node_layers.recorded(d, sb.id, forget=forget)
            except (TimeoutError, OSError, RuntimeError) as e:
                log.warning("sandbox %s: access list of %s not saved: %s", sb.id, d[:12], e)
                continue
            if got and got[1]:
                data, chunks = got
                self.node.layers.set_access_list(data, chunks, f"recorded by {sb.id}")
                saved[data] = len(chunks)
        if saved:
            self.node.on_event(sb.id, "access_list", f"saved {sum(saved.values())} chunks for {len(saved)} blob(s)")
        return saved
