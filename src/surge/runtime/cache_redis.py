"""The shared cache tier on Redis: replicas of one model version share hits.

Keys are `surge:<model>:<version>:<sha256 of (options, normalized input)>`, so
two versions never share entries. Values are a 4-byte token count followed by
the float32 vector. Redis is an optimization, never a dependency: any Redis
error counts as a miss, and after one the tier rests for a few seconds instead
of slowing every request down.
"""

from __future__ import annotations

import logging
import struct
import time

import numpy as np

from surge.runtime.cache import key_hash

log = logging.getLogger("surge.cache")

_HEADER = struct.Struct("<I")


class RedisTier:
    def __init__(self, url: str, model: str, version: str, ttl_s: int, timeout_s: float = 0.25,
                 backoff_s: float = 5.0, build: str = ""):
        import redis.asyncio as aredis

        self.client = aredis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        # build: the worker's fingerprint, so that a version reloaded with other
        # settings or weights starts from an empty shared tier.
        self.prefix = f"surge:{model}:{version}:{build}:" if build else f"surge:{model}:{version}:"
        self.ttl_s = ttl_s
        self.backoff_s = backoff_s
        self._down_until = 0.0
        self.errors = 0

    def redis_key(self, key: tuple) -> str:
        return self.prefix + key_hash(key).hexdigest()

    @property
    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    def _failed(self, exc: Exception) -> None:
        self.errors += 1
        self._down_until = time.monotonic() + self.backoff_s
        log.warning("redis cache tier unavailable for %.0f s: %s", self.backoff_s, exc)

    async def get_many(self, keys: list[tuple], width: int | None = None) -> list[tuple[np.ndarray, int] | None]:
        """The (vector, tokens) stored under each key, or None: absent, unreadable, or (`width` given)
        a vector of another width. A value is whatever the key's last writer put there (another surge
        release, another program): one this process cannot read is a miss, never an error."""
        if not keys or not self.available:
            return [None] * len(keys)
        try:
            raw = await self.client.mget([self.redis_key(k) for k in keys])
        except Exception as exc:  # redis errors, timeouts, refused connections
            self._failed(exc)
            return [None] * len(keys)
        return [_decode(value, width) for value in raw]

    async def put_many(self, items: list[tuple[tuple, np.ndarray, int]]) -> None:
        if not items or not self.available:
            return
        try:
            async with self.client.pipeline(transaction=False) as pipe:
                for key, vec, tokens in items:
                    pipe.set(self.redis_key(key), _HEADER.pack(tokens) + np.asarray(vec, np.float32).tobytes(),
                             ex=self.ttl_s)
                await pipe.execute()
        except Exception as exc:
            self._failed(exc)

    async def get_bytes(self, key: tuple) -> bytes | None:
        """One value as stored by put_bytes (a miss on any error, as get_many)."""
        if not self.available:
            return None
        try:
            return await self.client.get(self.redis_key(key))
        except Exception as exc:
            self._failed(exc)
            return None

    async def put_bytes(self, key: tuple, value: bytes) -> None:
        if not self.available:
            return
        try:
            await self.client.set(self.redis_key(key), value, ex=self.ttl_s)
        except Exception as exc:
            self._failed(exc)

    async def close(self) -> None:
        try:
            await self.client.aclose()
        except Exception:
            pass


def _decode(value: bytes | None, width: int | None) -> tuple[np.ndarray, int] | None:
    if value is None or len(value) < _HEADER.size + 4 or (len(value) - _HEADER.size) % 4:
        return None
    vec = np.frombuffer(value, dtype=np.float32, offset=_HEADER.size)
    if width is not None and vec.size != width:
        return None
    (tokens,) = _HEADER.unpack_from(value)
    return vec, tokens


async def shared_lookup(cache, redis: "RedisTier", keys: list, miss: list[int], fill,
                        width: int | None = None) -> list[int]:
    """Look the local tiers' misses up in the shared tier (ResultCache.fill_from, tier "shared");
    the positions still missing. `width`: the vectors' expected size where the caller knows it."""
    return cache.fill_from("shared", keys, miss, await redis.get_many([keys[i] for i in miss], width), fill)
