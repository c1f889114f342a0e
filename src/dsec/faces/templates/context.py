"""Build contexts: the tar archives E2B's SDKs upload for COPY steps, kept per project by
the hash the SDK computed over the files (so a second build of unchanged files uploads
nothing). They live beside the layers, in the store every node and replica sees.

Per project, because the server cannot check an upload against its hash: the SDKs hash
the client's own file metadata (the JS SDK a directory's size on the client's filesystem,
which no tar carries; the Python SDK does not), so the same files give different hashes
from different SDKs, and a hash names whatever its first uploader sent. Another project
that predicts the hash (it is deterministic over files it may know) uploads into its own
namespace only; within a project, the first upload wins and upload URLs go to builders."""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
import urllib.parse
from collections.abc import AsyncIterator

from dsec.faces.templates.models import FILES_HASH_RE
from dsec.shared.errors import InvalidRequest, PayloadTooLarge

MAX_CONTEXT_BYTES = 1 << 30


class Contexts:
    def __init__(self, root: str, max_bytes: int = MAX_CONTEXT_BYTES) -> None:
        self.dir = os.path.join(root, "template-files")
        self.max_bytes = max_bytes

    def path(self, project: str, files_hash: str) -> str:
        if not FILES_HASH_RE.match(files_hash):
            raise InvalidRequest(f"files hash {files_hash!r} is not a lowercase hex SHA-256", field="hash")
        if not project:
            raise InvalidRequest("a build context belongs to a project", field="project")
        return os.path.join(self.dir, urllib.parse.quote(project, safe=""), files_hash)

    def has(self, project: str, files_hash: str) -> bool:
        return os.path.exists(self.path(project, files_hash))

    async def save(self, project: str, files_hash: str, body: AsyncIterator[bytes]) -> int:
        """Store an upload (at most ``max_bytes``); published whole or not at all, and never
        over an earlier upload of the same hash in the same project."""
        dest = self.path(project, files_hash)
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(dest), prefix=".upload-")
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

    def read(self, project: str, files_hash: str) -> bytes:
        try:
            with open(self.path(project, files_hash), "rb") as f:
                return f.read()
        except FileNotFoundError:
            raise InvalidRequest(f"the files of hash {files_hash} were never uploaded", field="filesHash") from None
