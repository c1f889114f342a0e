"""Build contexts: the tar archives E2B's SDKs upload for COPY steps, kept by the hash the
SDK computed over the files (so a second build of unchanged files uploads nothing). They
live beside the layers, in the store every node and replica sees."""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
from collections.abc import AsyncIterator

from dsec.errors import InvalidRequest, PayloadTooLarge
from dsec.templates.models import FILES_HASH_RE

MAX_CONTEXT_BYTES = 1 << 30


class Contexts:
    def __init__(self, root: str, max_bytes: int = MAX_CONTEXT_BYTES) -> None:
        self.dir = os.path.join(root, "template-files")
        self.max_bytes = max_bytes

    def path(self, files_hash: str) -> str:
        if not FILES_HASH_RE.match(files_hash):
            raise InvalidRequest(f"files hash {files_hash!r} is not a lowercase hex SHA-256", field="hash")
        return os.path.join(self.dir, files_hash)

    def has(self, files_hash: str) -> bool:
        return os.path.exists(self.path(files_hash))

    async def save(self, files_hash: str, body: AsyncIterator[bytes]) -> int:
        """Store an upload (at most ``max_bytes``); published whole or not at all, and never
        over an earlier upload of the same hash."""
        dest = self.path(files_hash)
        os.makedirs(self.dir, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=".upload-")
        size = 0
        try:
            with os.fdopen(fd, "wb") as f:
                async for chunk in body:
                    size += len(chunk)
                    if size > self.max_bytes:
                        raise PayloadTooLarge(f"a build context is at most {self.max_bytes} bytes", field="body")
                    await asyncio.to_thread(f.write, chunk)
            # first upload wins: an upload URL is signed for a hash, not for who sends it, so a
            # later one must not replace what a build may already have been given
            try:
                os.link(tmp, dest)
            except FileExistsError:
                pass
            os.unlink(tmp)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return size

    def read(self, files_hash: str) -> bytes:
        try:
            with open(self.path(files_hash), "rb") as f:
                return f.read()
        except FileNotFoundError:
            raise InvalidRequest(f"the files of hash {files_hash} were never uploaded", field="filesHash") from None
