"""The bounded set of shapes a CUDA-graph engine runs: every one is built before ready.

A CUDA graph fixes its shapes, so the engine rounds each batch up to a bucket
and replays that bucket's graph. If buckets were made on demand (as the first
version of the torch engine did: batch rounded to a power of two x tokens
rounded by 1/8 x longest sequence rounded to a power of two, a few hundred
combinations), traffic keeps meeting new ones while serving and each costs a
capture plus Triton compilation and autotuning: tens to hundreds of ms on the
engine thread, which was 61% of its time under load.

Here the set is small, known up front and documented:

- tokens `tb`: 16, 32, then alternately x1.5 and x1.33 (48, 64, 96, 128, 192,
  256, ...) up to the engine's token capacity, which is always a member. A
  batch pads its packed tokens by at most 50% (GEMMs run on tb rows).
- longest sequence `lb`: 32 for batches of short sequences (the attention
  kernel's small blocks), else `min(max_len, next_pow2(tb))` rounded to a power
  of two. lb sizes the attention grid only: programs past a sequence's end
  exit at once, so a larger lb costs launches, not math.
- sequences `bb`: `min(batch_cap, tb)` (a batch of t tokens has at most t
  sequences); empty slots exit at once in attention.

So a model with a token capacity of 8192 has 18 token steps and 32 buckets.
Every batch the engine accepts (tokens <= capacity, sequences <= max_batch,
longest <= max_len) maps to one bucket; `key` never invents a new one.
"""

from __future__ import annotations

import bisect


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def token_steps(cap: int) -> list[int]:
    """16, 32, 48, 64, 96, 128, 192, 256, ... (multiples of 16), then `cap` itself."""
    out, t = [], 16
    while t < cap:
        out.append(t)
        half = t // 2
        # 32 -> 48 -> 64 -> 96 -> 128: a power of two, then 1.5 times it
        t = t + half if t & (t - 1) == 0 and t >= 32 else next_pow2(t + 1)
    out.append(cap)
    return out


SHORT = 32  # the longest-sequence bucket for batches of short sequences


class Buckets:
    def __init__(self, max_batch: int, max_len: int, token_cap: int):
        if token_cap < 16 or token_cap % 16:
            raise ValueError(f"token capacity must be a positive multiple of 16, got {token_cap}")
        self.batch_cap = next_pow2(max_batch)
        self.max_len = max_len
        self.len_cap = max(16, next_pow2(max_len))
        self.token_cap = token_cap
        self.tokens = token_steps(token_cap)
        keys = []
        for tb in self.tokens:
            long = self._long(tb)
            if long > SHORT and tb <= self._bb(tb) * SHORT:
                keys.append((self._bb(tb), tb, SHORT))
            keys.append((self._bb(tb), tb, long))
        self.keys: tuple[tuple[int, int, int], ...] = tuple(keys)

    def _bb(self, tb: int) -> int:
        return min(self.batch_cap, tb)

    def _long(self, tb: int) -> int:
        return min(self.len_cap, max(16, next_pow2(tb)))

    def key(self, batch: int, tokens: int, longest: int) -> tuple[int, int, int]:
        """(sequences, tokens, longest) of the smallest bucket that holds the batch."""
        if tokens > self.token_cap or batch > self.batch_cap or longest > self.len_cap or batch > tokens:
            raise ValueError(f"a batch of {batch} sequences, {tokens} tokens, longest {longest} fits no bucket "
                             f"(capacity {self.token_cap} tokens, {self.batch_cap} sequences, length {self.len_cap})")
        tb = self.tokens[bisect.bisect_left(self.tokens, tokens)]
        long = self._long(tb)
        lb = SHORT if longest <= SHORT < long and tb <= self._bb(tb) * SHORT else long
        return self._bb(tb), tb, lb

    def __len__(self) -> int:
        return len(self.keys)
