"""Copying and trimming ONNX protobufs without copying tensors nobody keeps.

A ModelProto of a BERT-sized encoder is ~90 MB of initializers: `FromString(SerializeToString())`
copies all of it, and so does clearing a repeated field and extending it with the kept entries. The
INT8 search builds and measures dozens of candidate graphs: in a profile of one search these copies
were about a third of its time outside ONNX Runtime (docs/benchmarks.md, "The INT8 search's work outside
ONNX Runtime"; benchmarks/int8_search_cpu.py times them against the old forms).
"""

from __future__ import annotations

from collections.abc import Callable

import onnx


def drop_initializers(graph: onnx.GraphProto, unwanted: Callable[[onnx.TensorProto], bool]) -> int:
    """Delete, in place, the initializers for which unwanted(initializer) is true; returns how many.
    In place because clearing the list and extending it with the kept ones copies every kept tensor."""
    inits = graph.initializer
    gone = [i for i in range(len(inits)) if unwanted(inits[i])]
    for i in reversed(gone):
        del inits[i]
    return len(gone)


def copy_model(model: onnx.ModelProto, skip_initializers: set[str] = frozenset()) -> onnx.ModelProto:
    """A deep copy of `model` without the graph initializers named in skip_initializers (they are never
    copied: the caller replaces them). Every field this onnx knows is copied; the graph's own fields
    too, the initializers once."""
    out = onnx.ModelProto()
    _copy_fields(model, out, skip="graph")
    if model.HasField("graph"):
        _copy_fields(model.graph, out.graph, skip="initializer")
        out.graph.initializer.extend(i for i in model.graph.initializer if i.name not in skip_initializers)
    return out


def _repeated(fd) -> bool:
    flag = getattr(fd, "is_repeated", None)  # protobuf >= 5.29; `label` is gone in 7
    return flag if flag is not None else fd.label == fd.LABEL_REPEATED


def _copy_fields(src, dst, skip: str) -> None:
    for fd, value in src.ListFields():
        if fd.name == skip:
            continue
        if _repeated(fd):
            getattr(dst, fd.name).extend(value)
        elif fd.message_type is not None:
            getattr(dst, fd.name).CopyFrom(value)
        else:
            setattr(dst, fd.name, value)
