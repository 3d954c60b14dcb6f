"""runtime/gc_settle.settle: what is alive is frozen (later collections skip it); off with SURGE_GC_FREEZE=0."""

from __future__ import annotations

import gc

from surge.runtime import gc_settle


def test_settle_freezes_what_is_alive_and_can_be_turned_off(monkeypatch):
    gc.unfreeze()
    try:
        keep = [[i] for i in range(5000)]  # tracked, alive objects
        monkeypatch.setenv("SURGE_GC_FREEZE", "0")
        assert gc_settle.settle() is False and gc.get_freeze_count() == 0
        monkeypatch.delenv("SURGE_GC_FREEZE")
        assert gc_settle.settle() is True
        assert gc.get_freeze_count() >= len(keep)
        garbage = []
        garbage.append(garbage)  # a cycle made after the freeze is still collected
        del garbage
        assert gc.collect() >= 1
    finally:
        gc.unfreeze()
