"""Where the Responses API keeps its answers (server/http/responses_api.py): a stored response can be
read back (GET /v1/responses/{id}), listed by its input items, deleted, cancelled while it runs in the
background, and continued (`previous_response_id`: its conversation is the context of the next one).

Three kinds, one contract (coroutines `get`, `put`, `delete`; a record is a JSON-able dict):

- `MemoryStore`: one process's, least recently used first out past `entries` or `max_bytes`;
- `DirStore`: one JSON file a response in a directory, for the `--workers` front ends, which are
  processes of their own: the response front end A stored is there for the request that front end B
  takes next. A write goes to a temporary file renamed over the record (readers see the old record or
  the new one, never half of one); an unreadable file is a miss, never an error of the request;
- `RedisStore`: a key a response on a Redis server, for servers on several hosts (Ray Serve's ingress
  replicas, or servers behind one load balancer); Redis' own eviction bounds the count.

All drop records older than `ttl_s`; memory and directory stores hold at most `max_bytes` of records'
JSON (a record larger than that is not kept: its id then finds nothing, as an expired one's). Ids are
random (responses_api.new_id), so writers never race on one record except a background response and its cancel (the record's `cancel_requested`, which the
running side reads as its tokens arrive).
"""

from __future__ import annotations

import os
import re
import time
from collections import OrderedDict
from pathlib import Path

import orjson

_ID = re.compile(r"^[A-Za-z0-9_-]{1,128}$")


def valid_id(rid: str) -> bool:
    """An id a store can hold: what new_id makes (also the file name of DirStore, so never a path)."""
    return bool(_ID.match(rid))


class MemoryStore:
    def __init__(self, entries: int, ttl_s: float, max_bytes: int = 1 << 30):
        self.entries = entries
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self.bytes = 0  # the kept records' JSON sizes
        self._items: OrderedDict[str, tuple[float, dict, int]] = OrderedDict()

    async def get(self, rid: str) -> dict | None:
        item = self._items.get(rid)
        if item is None:
            return None
        if time.time() - item[0] > self.ttl_s:
            self._drop(rid)
            return None
        self._items.move_to_end(rid)
        return item[1]

    async def put(self, rid: str, record: dict) -> None:
        if not valid_id(rid):
            raise ValueError(f"not a response id: {rid!r}")
        self._drop(rid)
        size = len(orjson.dumps(record))  # what the other stores would write; records share no bytes here
        if self.entries <= 0 or size > self.max_bytes:
            return
        self._items[rid] = (time.time(), record, size)
        self.bytes += size
        while len(self._items) > self.entries or self.bytes > self.max_bytes:
            self._drop(next(iter(self._items)))

    def _drop(self, rid: str) -> bool:
        item = self._items.pop(rid, None)
        if item is None:
            return False
        self.bytes -= item[2]
        return True

    async def delete(self, rid: str) -> bool:
        return self._drop(rid)


class DirStore:
    PRUNE_EVERY = 64  # writes between two scans of the directory for records past the bounds

    def __init__(self, root: str | Path, entries: int, ttl_s: float, max_bytes: int = 1 << 30):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.entries = entries
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self._writes = 0
        self._written = 0  # bytes written since the last prune: past max_bytes / 8, the next write prunes

    def _path(self, rid: str) -> Path:
        if not valid_id(rid):
            raise ValueError(f"not a response id: {rid!r}")
        return self.root / f"{rid}.json"

    async def get(self, rid: str) -> dict | None:
        try:
            path = self._path(rid)
            if time.time() - path.stat().st_mtime > self.ttl_s:
                path.unlink(missing_ok=True)
                return None
            return orjson.loads(path.read_bytes())
        except (OSError, ValueError):
            return None

    async def put(self, rid: str, record: dict) -> None:
        if self.entries <= 0:
            return
        path = self._path(rid)
        data = orjson.dumps(record)
        if len(data) > self.max_bytes:
            path.unlink(missing_ok=True)  # its earlier state must not answer for it
            return
        tmp = path.with_name(f".{rid}.{os.getpid()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)
        self._writes += 1
        self._written += len(data)
        if self._writes % self.PRUNE_EVERY == 0 or self._written > self.max_bytes // 8:
            self.prune()

    async def delete(self, rid: str) -> bool:
        try:
            self._path(rid).unlink()
            return True
        except (OSError, ValueError):
            return False

    def prune(self) -> None:
        """Records past ttl_s, then the oldest past `entries` or `max_bytes`, removed."""
        self._written = 0
        now = time.time()
        files = []
        for entry in os.scandir(self.root):
            if not entry.name.endswith(".json"):
                continue
            try:
                st = entry.stat()
            except OSError:
                continue
            if now - st.st_mtime > self.ttl_s:
                Path(entry.path).unlink(missing_ok=True)
            else:
                files.append((st.st_mtime, entry.path, st.st_size))
        files.sort()
        total = sum(size for _, _, size in files)
        for k, (_, path, size) in enumerate(files):
            if len(files) - k <= self.entries and total <= self.max_bytes:
                break
            Path(path).unlink(missing_ok=True)
            total -= size


class RedisStore:
    PREFIX = "surge:responses:"

    def __init__(self, url: str, entries: int, ttl_s: float):
        import redis.asyncio as redis

        self.client = redis.Redis.from_url(url)
        self.entries = entries
        self.ttl_s = ttl_s

    async def get(self, rid: str) -> dict | None:
        if not valid_id(rid):
            return None
        raw = await self.client.get(self.PREFIX + rid)
        try:
            return None if raw is None else orjson.loads(raw)
        except ValueError:
            return None

    async def put(self, rid: str, record: dict) -> None:
        if not valid_id(rid):
            raise ValueError(f"not a response id: {rid!r}")
        if self.entries > 0:
            await self.client.set(self.PREFIX + rid, orjson.dumps(record), ex=max(1, int(self.ttl_s)))

    async def delete(self, rid: str) -> bool:
        return valid_id(rid) and bool(await self.client.delete(self.PREFIX + rid))


def store_for(config) -> MemoryStore | DirStore | RedisStore:
    """The store of a server (`config`: ResponsesConfig): Redis at its `store_redis_url`, else its
    `store_dir`, else under `--workers` (SURGE_SHM_DIR, set by the supervisor for its front ends) a
    directory there, else memory."""
    if config.store_redis_url:
        return RedisStore(config.store_redis_url, config.store_entries, config.store_ttl_s)
    root = config.store_dir
    if root is None and os.environ.get("SURGE_SHM_DIR"):
        root = Path(os.environ["SURGE_SHM_DIR"]) / "responses"
    if root is not None:
        return DirStore(root, config.store_entries, config.store_ttl_s, config.store_bytes)
    return MemoryStore(config.store_entries, config.store_ttl_s, config.store_bytes)
