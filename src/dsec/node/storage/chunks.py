"""Chunk indexes: the sha256 of every fixed-size chunk of a data blob.

Written beside the blob when it is published (``<digest>.chunks``) and copied to each
node with the metadata image. The node-side reader checks every chunk it fetches or
takes from its cache against this index, so a torn or corrupt chunk is refetched, never
served. Binary layout: magic, chunk size (u32), blob size (u64), then 32 bytes per chunk.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

MAGIC = b"DSECCHK1"
_HEAD = struct.Struct("<8sIQ")
DEFAULT_CHUNK_SIZE = 1 << 20


@dataclass(frozen=True)
class ChunkIndex:
    chunk_size: int
    size: int
    hashes: tuple[bytes, ...]

    @property
    def count(self) -> int:
        return len(self.hashes)

    def span(self, idx: int) -> tuple[int, int]:
        """(offset, length) of chunk ``idx`` in the blob."""
        off = idx * self.chunk_size
        return off, min(self.chunk_size, self.size - off)

    def chunks_for(self, offset: int, length: int) -> range:
        if length <= 0 or offset >= self.size:
            return range(0)
        end = min(self.size, offset + length)
        return range(offset // self.chunk_size, (end - 1) // self.chunk_size + 1)

    def to_bytes(self) -> bytes:
        return _HEAD.pack(MAGIC, self.chunk_size, self.size) + b"".join(self.hashes)

    @classmethod
    def from_bytes(cls, raw: bytes) -> ChunkIndex:
        if len(raw) < _HEAD.size:
            raise ValueError("chunk index truncated")
        magic, chunk_size, size = _HEAD.unpack_from(raw)
        if magic != MAGIC or chunk_size < 4096 or chunk_size & (chunk_size - 1):
            raise ValueError("not a chunk index")
        body = raw[_HEAD.size:]
        count = -(-size // chunk_size)
        if len(body) != 32 * count:
            raise ValueError(f"chunk index has {len(body) // 32} hashes, blob size needs {count}")
        return cls(chunk_size, size, tuple(body[i:i + 32] for i in range(0, len(body), 32)))

    @classmethod
    def build(cls, path: str, chunk_size: int = DEFAULT_CHUNK_SIZE) -> ChunkIndex:
        hashes = []
        size = 0
        with open(path, "rb") as f:
            while chunk := f.read(chunk_size):
                hashes.append(hashlib.sha256(chunk).digest())
                size += len(chunk)
        return cls(chunk_size, size, tuple(hashes))


def check_chunk_size(chunk_size: int) -> int:
    if chunk_size < 4096 or chunk_size > (64 << 20) or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk size {chunk_size} must be a power of two between 4 KiB and 64 MiB")
    return chunk_size
