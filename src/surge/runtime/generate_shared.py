"""The generation cache's shared tier (Redis, `--redis-url`): the keys, the stored form of an answer, and
what makes a decoder directory's answers what they are (replicas sharing the tier agree on it)."""

from __future__ import annotations

import logging
from pathlib import Path

import orjson

from surge.runtime.generate_delta import Delta

log = logging.getLogger("surge.generate")

DELTA_FIELDS = ("text", "token_ids", "logprobs", "finish_reason", "prompt_tokens", "completion_tokens",
                 "prompt_logprobs", "stop_reason", "cached_tokens")


def shared_key(key: tuple) -> tuple:
    """A generation-cache key (version, prompt ids, sampling key) as the shared tier's (options, input)."""
    version, ids, params = key
    return (version, params), ",".join(map(str, ids))


def pack(deltas: list[Delta]) -> bytes:
    return orjson.dumps([{f: getattr(d, f) for f in DELTA_FIELDS} for d in deltas])


def unpack(raw: bytes | None) -> list[Delta] | None:
    """Deltas as pack wrote them (the top log-probabilities' tuples come back as lists, which the routes
    unpack alike); None for nothing, or for what this release cannot read (another release's fields, a
    truncated write, another program's bytes): a miss, as a Redis error is, never the request's failure."""
    if raw is None:
        return None
    try:
        deltas = [Delta(**d) for d in orjson.loads(raw)]
    except (ValueError, TypeError) as exc:  # orjson.JSONDecodeError is a ValueError
        log.warning("unreadable generation in the shared cache tier, computed again: %s", exc)
        return None
    if not deltas or deltas[-1].finish_reason is None:
        return None  # not a whole answer
    return deltas


def attach_shared_cache(service, cache_config) -> None:
    """Give a generation service the shared tier of the server's cache settings (`--redis-url`): on Redis,
    keyed by model, version and the engine's device, precision and weight quantization (answers of another
    precision or of 8-bit weights never mix), for `--redis-ttl-s`. Nothing without a URL, with the cache off, or
    with the generation cache off."""
    if not (cache_config is not None and cache_config.enabled and cache_config.redis_url
            and service.config.cache_entries):
        return
    from surge.runtime.cache_redis import RedisTier

    caps = service.engine.capabilities
    build = f"generate:{getattr(caps, 'device', '')}:{getattr(caps, 'dtype', '')}"
    quant = getattr(caps, "quantization", "none")
    if quant != "none":  # (unquantized engines keep the keys they had)
        build += f":{quant}"
    weights = weights_fingerprint(getattr(service, "path", None))
    if weights:  # a version reloaded with other weights (or tokenizer) never reads the old weights' answers
        build += f":{weights}"
    service.shared = RedisTier(cache_config.redis_url, service.name, service.version, cache_config.redis_ttl_s,
                               build=build)


def weights_fingerprint(path) -> str:
    """What makes a decoder directory's answers what they are, the same in every process (replicas share the
    tier): its weight, tokenizer and config files sampled at 17 points each (runtime/file_sample.py), so that a
    fine-tune of the middle layers changes it too. "" without a directory."""
    import hashlib

    from surge.runtime.file_sample import update_sampled

    if path is None or not Path(path).is_dir():
        return ""
    path = Path(path)
    names = sorted({p.name for pattern in ("*.safetensors", "*.bin", "*.pt", "*.gguf") for p in path.glob(pattern)}
                   | {"tokenizer.json", "config.json", "generation_config.json", "tokenizer_config.json"})
    digest = hashlib.sha256()
    update_sampled(digest, path, names, samples=16)
    return digest.hexdigest()[:16]
