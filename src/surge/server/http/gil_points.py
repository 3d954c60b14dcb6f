"""Points in a long validation where the event loop can have the GIL.

pydantic validates a request in one native call that keeps the GIL: 45,000 chat messages (a 2 MB body) held it
~50 ms for the model and as long again for fail_fast's twin, on a preparation thread, and the event loop, which
needs the GIL to answer anyone, waited that long (benchmarks/loop_stall.py). A Python function called per item
is a point where the interpreter hands the GIL over when another thread has waited its switch interval (5 ms),
so the loop runs every few milliseconds instead. It costs ~0.2 us an item (45,000 messages: ~10 ms of CPU,
against ~100 ms of validation), so it is for lists of objects (models, dicts), not of ints or short strings.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BeforeValidator


def _point(value):
    return value


def each(item):
    """`item`, validated after a call of a Python function (a point where the GIL can change hands): for the
    items of a long list, `list[each(Model)]`. The value, its errors and its schema are `item`'s."""
    return Annotated[item, BeforeValidator(_point)]
