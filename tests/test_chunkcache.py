"""The node's chunk cache and chunk indexes on their own, on real local disk: bounds,
LRU order, restart survival, corruption, torn writes, concurrent readers."""

from __future__ import annotations

import hashlib
import os
import random
import threading

import pytest

from dsec.node.storage.cache import ChunkCache
from dsec.node.storage.chunks import ChunkIndex, check_chunk_size

KiB = 1024


def _chunk(i: int, size: int = 64 * KiB) -> tuple[bytes, bytes]:
    data = random.Random(i).randbytes(size)
    return hashlib.sha256(data).digest(), data


def test_lru_bound_and_order_survive_restart(tmp_path: str) -> None:
    root = os.path.join(tmp_path, "cache")
    cache = ChunkCache(root, max_bytes=3 * 64 * KiB)
    chunks = [_chunk(i) for i in range(4)]
    for h, d in chunks[:3]:
        cache.put(h, d)
        os.utime(cache._path(h.hex()), (1, 1 + len(cache._lru)))  # distinct mtimes on coarse clocks
    assert cache.get(chunks[0][0]) == chunks[0][1]  # 0 becomes most recent; 1 is now the oldest
    cache.put(*chunks[3])
    assert cache.bytes <= cache.max_bytes and cache.evictions == 1
    assert cache.get(chunks[1][0]) is None
    assert not os.path.exists(cache._path(chunks[1][0].hex()))

    again = ChunkCache(root, max_bytes=2 * 64 * KiB)  # a restart with a smaller bound
    assert again.entries == 2 and again.bytes == 2 * 64 * KiB
    assert again.get(chunks[0][0]) == chunks[0][1] and again.get(chunks[3][0]) == chunks[3][1]
    assert again.get(chunks[2][0]) is None  # the least recently used one went first


def test_corrupt_and_torn_chunks_are_never_served(tmp_path: str) -> None:
    root = os.path.join(tmp_path, "cache")
    cache = ChunkCache(root, max_bytes=1 << 30)
    (h1, d1), (h2, d2) = _chunk(1), _chunk(2)
    cache.put(h1, d1)
    cache.put(h2, d2)
    with open(cache._path(h1.hex()), "r+b") as f:
        f.seek(100)
        f.write(b"\x00\xff")
    with open(cache._path(h2.hex()), "r+b") as f:
        f.truncate(1000)  # torn: a crash mid-write of a file that was renamed anyway
    assert cache.get(h1) is None and cache.get(h2) is None
    assert cache.corrupt == 2 and cache.entries == 0
    assert not os.listdir(os.path.join(root, h1.hex()[:2]))
    # leftovers of writes cut short never count as chunks after a restart
    tmp = os.path.join(root, "ab", ".tmpxyz")
    os.makedirs(os.path.dirname(tmp), exist_ok=True)
    with open(tmp, "wb") as f:
        f.write(b"partial")
    again = ChunkCache(root, max_bytes=1 << 30)
    assert again.entries == 0 and not os.path.exists(tmp)


def test_concurrent_readers_and_writers(tmp_path: str) -> None:
    cache = ChunkCache(os.path.join(tmp_path, "cache"), max_bytes=8 * 64 * KiB)
    chunks = [_chunk(i) for i in range(16)]
    bad: list[str] = []

    def work(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(300):
            h, d = chunks[rng.randrange(len(chunks))]
            if rng.random() < 0.5:
                cache.put(h, d)
            else:
                got = cache.get(h)
                if got is not None and got != d:
                    bad.append(h.hex())

    threads = [threading.Thread(target=work, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad
    assert cache.bytes <= cache.max_bytes
    on_disk = sum(len(files) for _, _, files in os.walk(cache.root))
    assert on_disk == cache.entries and cache.corrupt == 0


def test_chunk_index_roundtrip_and_ranges(tmp_path: str) -> None:
    path = os.path.join(tmp_path, "blob")
    data = random.Random(7).randbytes(3 * 4096 + 10)
    with open(path, "wb") as f:
        f.write(data)
    idx = ChunkIndex.build(path, 4096)
    assert idx.count == 4 and idx.size == len(data) and idx.span(3) == (3 * 4096, 10)
    assert list(idx.chunks_for(4000, 200)) == [0, 1] and list(idx.chunks_for(len(data), 5)) == []
    assert ChunkIndex.from_bytes(idx.to_bytes()) == idx
    with pytest.raises(ValueError):
        ChunkIndex.from_bytes(idx.to_bytes()[:-1])
    with pytest.raises(ValueError):
        check_chunk_size(3000)
