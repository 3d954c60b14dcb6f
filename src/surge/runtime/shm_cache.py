"""The hot-query cache tier that every `--workers` front end shares: a table in shared memory.

Each front end keeps its own in-process tiers (runtime/cache.py); without this one, a query that
front end A answered was a miss for front end B, which then asked the engine process. The table is
one memory-mapped file per vector width (in /dev/shm where it exists), set-associative (two ways a
bucket, the older entry replaced), sized by `--cache-bytes`:

- a lookup is lock-free: copy the bucket, keep a way whose key matches, whose sequence number is
  even and unchanged after the copy, and whose CRC-32 over key, token count and vector matches (a
  torn read, or a writer in another process halfway through, is a miss, never a wrong vector);
- a write takes a POSIX record lock on its bucket's bytes (`fcntl.lockf`), makes the sequence odd,
  writes, makes it even: any number of writer processes, one at a time per bucket.

Keys are the first 16 bytes of SHA-256 over (model, version, engine build, options, text), so models,
versions and builds never share an entry (`ShmTier.key`). Tested with writer and reader processes
racing on a small table (tests/unit/test_shm_cache.py) and end to end across two front ends
(tests/e2e/test_workers_shared_cache.py).
"""

from __future__ import annotations

import fcntl
import os
import time
import zlib
from pathlib import Path

import numpy as np

from surge.runtime.cache import key_hash

WAYS = 2
_MAGIC = np.uint64(0x53555247455F5331)  # "SURGE_S1"


def _dtype(dim: int) -> np.dtype:
    return np.dtype([("seq", "<u8"), ("stamp", "<u8"), ("key", "<u8", (2,)), ("tokens", "<u4"), ("crc", "<u4"),
                     ("vec", "<f4", (dim,))])


class ShmTable:
    """One shared table of float32 vectors of width `dim`, at most `max_bytes` (>= one bucket)."""

    def __init__(self, path: str | Path, dim: int, max_bytes: int):
        self.dim = dim
        self.rec = _dtype(dim)
        self.buckets = max(1, int(max_bytes) // (WAYS * self.rec.itemsize))
        head = 64
        size = head + self.buckets * WAYS * self.rec.itemsize
        self.path = str(path)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        if os.fstat(self.fd).st_size < size:  # every process asks for the same size: idempotent
            os.ftruncate(self.fd, size)
        self._mm = np.memmap(self.path, dtype=np.uint8, mode="r+", shape=(size,))
        meta = self._mm[:head].view("<u8")
        if meta[0] == 0:
            meta[1], meta[2] = dim, self.buckets
            meta[0] = _MAGIC
        if meta[0] != _MAGIC or meta[1] != dim or meta[2] != self.buckets:
            raise ValueError(f"{self.path}: a table of another shape ({int(meta[1])} x {int(meta[2])} buckets)")
        self._head = head
        self.table = self._mm[head:].view(self.rec).reshape(self.buckets, WAYS)

    @staticmethod
    def _crc(key: np.ndarray, tokens: int, vec: np.ndarray) -> int:
        return zlib.crc32(vec.tobytes(), zlib.crc32(key.tobytes() + int(tokens).to_bytes(4, "little")))

    def get(self, digest: bytes) -> tuple[np.ndarray, int] | None:
        k = np.frombuffer(digest, "<u8", 2)
        b = int(k[0] % self.buckets)
        snap = self.table[b].copy()
        for w in range(WAYS):
            r = snap[w]
            seq = int(r["seq"])
            if seq & 1 or r["key"][0] != k[0] or r["key"][1] != k[1]:
                continue
            if int(self.table[b, w]["seq"]) != seq:  # rewritten while copied
                continue
            if self._crc(r["key"], int(r["tokens"]), r["vec"]) != int(r["crc"]):
                continue
            return np.array(r["vec"], dtype=np.float32), int(r["tokens"])
        return None

    def put(self, digest: bytes, vec: np.ndarray, tokens: int) -> None:
        vec = np.ascontiguousarray(vec, dtype=np.float32).reshape(self.dim)
        k = np.frombuffer(digest, "<u8", 2)
        b = int(k[0] % self.buckets)
        off = self._head + b * WAYS * self.rec.itemsize
        fcntl.lockf(self.fd, fcntl.LOCK_EX, WAYS * self.rec.itemsize, off, os.SEEK_SET)
        try:
            row = self.table[b]
            same = [w for w in range(WAYS) if row[w]["key"][0] == k[0] and row[w]["key"][1] == k[1]]
            w = same[0] if same else int(np.argmin(row["stamp"]))
            rec = self.table[b, w:w + 1]
            seq = int(rec["seq"][0])
            rec["seq"] = seq + 1 + (seq & 1)  # odd: being written (a crashed writer left it odd: skip it)
            rec["key"] = k
            rec["tokens"] = tokens
            rec["vec"] = vec
            rec["stamp"] = time.monotonic_ns()  # system-wide on Linux: the older way is replaced
            rec["crc"] = self._crc(k, tokens, vec)
            rec["seq"] = int(rec["seq"][0]) + 1  # even: complete
        finally:
            fcntl.lockf(self.fd, fcntl.LOCK_UN, WAYS * self.rec.itemsize, off, os.SEEK_SET)


class ShmTier:
    """One model version's view of a shared table (ResultCache keys in, vectors out)."""

    def __init__(self, table: ShmTable, model: str, version: str, build: str = ""):
        self.table = table
        self.prefix = f"{model}\0{version}\0{build}\0".encode()

    def key(self, key: tuple) -> bytes:
        return key_hash(key, self.prefix).digest()[:16]

    def get(self, key: tuple) -> tuple[np.ndarray, int] | None:
        return self.table.get(self.key(key))

    def put(self, key: tuple, vec: np.ndarray, tokens: int) -> None:
        """Stored when the vector has the table's width (a `dimensions` option that shortens it: not)."""
        if vec.size == self.table.dim:
            self.table.put(self.key(key), vec, tokens)


def table_dir() -> Path:
    """Where a supervisor's tables go: SURGE_SHM_DIR (the supervisor sets it for its children)."""
    return Path(os.environ["SURGE_SHM_DIR"])


_TABLES: dict[int, ShmTable] = {}


def shared_table(dim: int, max_bytes: int) -> ShmTable | None:
    """This process's handle on the supervisor's table for width `dim` (None outside --workers)."""
    if "SURGE_SHM_DIR" not in os.environ or max_bytes <= 0:
        return None
    t = _TABLES.get(dim)
    if t is None:
        t = _TABLES[dim] = ShmTable(table_dir() / f"cache_{dim}.shm", dim, max_bytes)
    return t
