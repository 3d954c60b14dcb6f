"""The paged KV cache's bookkeeping: fixed-size blocks, reference counts, prefix cache.

A block holds `block_size` tokens' K/V for every layer (the engine owns the
memory; this class only hands out block numbers). A full block is named by a
chained hash of its tokens and of every token before it, so two sequences with
the same prefix (the assistant's system prompt) share the blocks: the second
one starts with those tokens already computed. Freed blocks keep their hash
and contents until they are reused, least recently freed first, so a prefix
stays cached while memory allows.

While launched steps are in flight (runtime/scheduler/overlap.py) a block may still be written by the
device after the host has freed it (a sequence found stopped, or aborted, is in the launches behind)
or named it (its last position's K/V comes from the next launch). Both bump `clock` and stamp the
block, so a step run beside those launches can check that none of its blocks was touched since the
oldest of them was made (`settled`).
"""

from __future__ import annotations

from collections import OrderedDict

from surge.runtime.scheduler.sequence import PLACEHOLDER, Sequence

_ROOT = 0x5EED


def chain_hash(parent: int, tokens) -> int:
    return hash((parent, tuple(tokens)))


def root_hash(seq: Sequence) -> int:
    """The chain's start: a LoRA adapter's K/V of the same tokens differ from the base model's."""
    return _ROOT if not seq.adapter_uid else chain_hash(_ROOT, ("lora", seq.adapter_uid))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.ref = [0] * num_blocks
        self.hash_of: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # chained hash -> block
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.queried_tokens = 0  # prompt tokens looked up in the prefix cache
        self.hit_tokens = 0  # of those, found
        self.clock = 0  # bumped when a block is freed, or named from a launched step's tokens
        self.touched = [0] * num_blocks  # the clock at a block's last such change

    def _touch(self, block: int) -> None:
        self.clock += 1
        self.touched[block] = self.clock

    def settled(self, blocks, since: int) -> bool:
        """None of `blocks` was freed or named from launched tokens after the clock read `since`: launches
        made at or after that reading cannot be writing them."""
        touched = self.touched
        return all(touched[b] <= since for b in blocks)

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free) / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- admission ---------------------------------------------------------------------------------
    def looks_up(self, seq: Sequence) -> bool:
        """Whether allocate_prefix looks `seq` up in the prefix cache: not with prefix caching off, nor for a
        prompt whose positions are still to be scored (prompt logprobs: computed, never taken from the cache).
        Only those tokens count as queried (the hit rate's denominator)."""
        return self.prefix_caching and not seq.owes_prompt_logprobs

    def allocate_prefix(self, seq: Sequence) -> None:
        """Give a new (or preempted) sequence the cached blocks of its longest known prefix.
        At least one token is left to compute: its logits give the next token."""
        bs = self.block_size
        seq.block_table, seq.block_hashes, seq.num_computed = [], [], 0
        if not self.looks_up(seq):
            return
        parent = root_hash(seq)
        usable = (seq.num_tokens - 1) // bs
        for i in range(usable):
            h = chain_hash(parent, seq.token_ids[i * bs:(i + 1) * bs])
            block = self.cached.get(h)
            if block is None:
                break
            self._acquire(block)
            seq.block_table.append(block)
            seq.block_hashes.append(h)
            parent = h
        seq.num_computed = len(seq.block_table) * bs
        seq.num_cached_prompt = seq.num_computed

    def _acquire(self, block: int) -> None:
        if self.ref[block] == 0:
            del self.free[block]
        self.ref[block] += 1

    def ensure(self, seq: Sequence, num_tokens: int) -> bool:
        """Blocks for the first `num_tokens` tokens of `seq`; False (nothing taken) if memory is short."""
        need = self.blocks_for(num_tokens) - len(seq.block_table)
        if need <= 0:
            return True
        if need > len(self.free):
            return False
        for _ in range(need):
            block, _ = self.free.popitem(last=False)  # least recently freed
            old = self.hash_of[block]
            if old is not None:  # evicted from the prefix cache
                if self.cached.get(old) == block:
                    del self.cached[old]
                self.hash_of[block] = None
            self.ref[block] = 1
            seq.block_table.append(block)
        return True

    def commit(self, seq: Sequence, launched: bool = False) -> None:
        """Name the blocks that became full (computed) so later sequences can share them. `launched`: the
        tokens come from a launched step, whose last K/V may still be being written (stamped)."""
        if not self.prefix_caching:
            return
        bs = self.block_size
        known = min(seq.num_computed, seq.num_tokens)
        # with several launched steps in flight the newest computed inputs are still placeholders
        # (engines gather them on the device): only blocks of known tokens are named
        while known and seq.token_ids[known - 1] == PLACEHOLDER:
            known -= 1
        full = known // bs
        parent = seq.block_hashes[-1] if seq.block_hashes else root_hash(seq)
        for i in range(len(seq.block_hashes), full):
            h = chain_hash(parent, seq.token_ids[i * bs:(i + 1) * bs])
            block = seq.block_table[i]
            if h not in self.cached:
                self.cached[h] = block
                self.hash_of[block] = h
            if launched:
                self._touch(block)
            seq.block_hashes.append(h)
            parent = h

    def release(self, seq: Sequence) -> None:
        """Give back a sequence's blocks (finished, aborted or preempted). The tail goes
        first into the free list, so it is reused before the shared head."""
        for block in reversed(seq.block_table):
            self.ref[block] -= 1
            if self.ref[block] == 0:
                self.free[block] = None
                self._touch(block)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed = 0

    def check(self) -> None:
        """Invariants (for tests): free blocks have no references, counts add up."""
        assert all(self.ref[b] == 0 for b in self.free)
        assert sum(1 for r in self.ref if r > 0) + len(self.free) == self.num_blocks
        assert all(r >= 0 for r in self.ref)
