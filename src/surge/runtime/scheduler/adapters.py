"""Which LoRA adapter each engine slot holds: adapters swapped into slots as sequences are admitted.

More adapters may be registered than the engine has slots (vLLM's max_cpu_loras over max_loras): each
registered adapter is read once and kept in host memory; a sequence is admitted only when its adapter
holds a slot or can be given one, a free slot or, least recently used first, one that no admitted
sequence uses (its weights are then overwritten in place, after the steps already queued on the device
that may still read them). A sequence whose adapter cannot get a slot now waits while others behind it
are admitted; a slot is released when its last sequence finishes or is preempted.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable

from surge.runtime.scheduler.sequence import Sequence


PENDING = object()  # registered, its files still being read: its sequences wait


class AdapterSlots:
    def __init__(self, slots: int, load: Callable[[int, object], None]):
        """`load(slot, adapter)` writes a registered adapter's weights into an engine slot (1..slots)."""
        self.slots = slots
        self._load = load
        self.known: dict[int, object] = {}  # uid -> the adapter as registered (host memory)
        # unregistered while sequences of theirs still wait or run: kept until the last one ends
        self.retired: set[int] = set()
        self.slot_of: dict[int, int] = {}  # uid -> the slot holding it
        self.held: list[int | None] = [None] * (slots + 1)  # slot -> uid
        self.users = [0] * (slots + 1)  # slot -> admitted sequences reading it
        self._recent: OrderedDict[int, None] = OrderedDict((s, None) for s in range(1, slots + 1))
        self.loads = 0  # adapters written into slots (the first time or again after an eviction)

    def register(self, uid: int, adapter) -> None:
        """Keep `adapter` for sequences of `uid` (PENDING: not read yet, they wait). A uid is a digest of
        the adapter's files: registered again, it is the same weights."""
        self.known[uid] = adapter
        self.retired.discard(uid)

    def forget(self, uid: int, in_use: bool = False) -> None:
        """No new sequence will ask for `uid`. `in_use`: sequences of it still wait or run; it is dropped at
        the last one's end (`drop`), its slot then reusable."""
        if in_use:
            self.retired.add(uid)
        else:
            self.drop(uid)

    def drop(self, uid: int) -> None:
        self.retired.discard(uid)
        self.known.pop(uid, None)
        slot = self.slot_of.get(uid)
        if slot is not None and self.users[slot] == 0:
            self._evict(slot)

    def acquire(self, seq: Sequence) -> bool:
        """Give `seq` its adapter's slot (`seq.adapter`), writing the adapter into one if needed; False when
        every slot is read by admitted sequences of other adapters. KeyError: `uid` was never registered."""
        uid = seq.adapter_uid
        if not uid:
            seq.adapter = 0
            return True
        slot = self.slot_of.get(uid)
        if slot is None:
            adapter = self.known[uid]
            if adapter is PENDING:
                return False
            # a free slot, else the least recently used one no admitted sequence reads
            slot = next((s for s in self._recent if self.held[s] is None), None) or \
                next((s for s in self._recent if self.users[s] == 0), None)
            if slot is None:
                return False
            self._evict(slot)
            self._load(slot, adapter)
            self.loads += 1
            self.held[slot], self.slot_of[uid] = uid, slot
        self.users[slot] += 1
        self._recent.move_to_end(slot)
        seq.adapter = slot
        return True

    def release(self, seq: Sequence) -> None:
        """`seq` was admitted and no longer runs (finished, aborted or preempted)."""
        slot = seq.adapter
        if slot:
            self.users[slot] -= 1
            seq.adapter = 0

    def _evict(self, slot: int) -> None:
        uid = self.held[slot]
        if uid is not None:
            del self.slot_of[uid]
            self.held[slot] = None
