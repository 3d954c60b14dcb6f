"""Small helpers shared by the CLI and the benchmark scripts."""

from __future__ import annotations


def run_coro(coro):
    """Run a coroutine on uvloop when installed (lower per-request overhead), else asyncio."""
    try:
        import uvloop
    except ImportError:
        import asyncio

        return asyncio.run(coro)
    return uvloop.run(coro)
