"""runtime/gc_settle: settle freezes what is alive (later collections skip it), off with SURGE_GC_FREEZE=0 or
the server's gc_freeze; resettle(thaw=True) frees frozen objects held only by a reference cycle."""

from __future__ import annotations

import gc
import os
import weakref

from surge.runtime import gc_settle


def test_settle_freezes_what_is_alive_and_can_be_turned_off(monkeypatch, thawed):
    keep = [[i] for i in range(5000)]  # tracked, alive objects
    for off in ("0", "false"):
        monkeypatch.setenv("SURGE_GC_FREEZE", off)
        assert gc_settle.settle() is False and gc.get_freeze_count() == 0
    assert gc_settle.settle(False) is False and gc.get_freeze_count() == 0
    assert gc_settle.resettle(thaw=True) is False  # never settled: nothing to do
    monkeypatch.delenv("SURGE_GC_FREEZE")
    assert gc_settle.settle() is True
    assert gc.get_freeze_count() >= len(keep)
    garbage = []
    garbage.append(garbage)  # a cycle made after the freeze is still collected
    del garbage
    assert gc.collect() >= 1


def test_configure_reaches_the_processes_the_server_spawns(monkeypatch, thawed):
    monkeypatch.delenv("SURGE_GC_FREEZE", raising=False)
    gc_settle.configure(False)
    assert os.environ["SURGE_GC_FREEZE"] == "0" and not gc_settle.enabled()
    gc_settle.configure(True)
    assert gc_settle.enabled()


class Model:
    """Stands for a loaded model's objects: held in a reference cycle, as a built encoder service is."""

    def __init__(self):
        self.me = self


def test_a_frozen_cycle_is_freed_once_resettled_with_a_thaw(thawed):
    model = Model()
    ref = weakref.ref(model)
    assert gc_settle.settle(True)
    del model
    gc.collect()
    assert ref() is not None  # frozen: the collector never frees it
    assert gc_settle.resettle(thaw=False)
    assert ref() is not None
    assert gc_settle.resettle(thaw=True)
    assert ref() is None
    later = Model()
    assert gc_settle.resettle(thaw=False)
    assert not any(o is later for o in gc.get_objects()), "a model loaded after the start is frozen too"
