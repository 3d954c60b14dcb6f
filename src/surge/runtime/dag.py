"""DAG pipelines: `pipeline.yaml` wires models, built-in steps and user functions.

Checked when loaded: unknown nodes or outputs, unconnected inputs, type
mismatches and cycles are ConfigErrors naming the file and the field. At run
time every node is a task that awaits exactly the nodes it reads from, so
independent branches run concurrently; a node with a `when` condition that does
not hold is skipped, and so is everything that reads from it (their outputs are
null in the response).
"""

from __future__ import annotations

import asyncio
import graphlib
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from surge.config import PipelineFile, load_yaml_file
from surge.errors import ConfigError, InvalidInput, NotFound, Unprocessable, relative_paths, shown
from surge.runtime.steps import Embedding, LoadContext, Node, check_value, make_node

INPUT = "input"
SKIPPED = object()


def compatible(src: str, dst: str) -> bool:
    return src == dst or "any" in (src, dst) or (src, dst) == ("label", "text")


@dataclass
class Ref:
    node: str  # a node name, or INPUT for the request's inputs
    port: str


class Pipeline:
    def __init__(self, name: str, file: Path, spec: PipelineFile, nodes: dict[str, Node],
                 wiring: dict[str, dict[str, Ref]], conditions: dict[str, tuple[Ref, list]], order: list[str]):
        self.name = name
        self.file = file
        self.spec = spec
        self.nodes = nodes
        self.wiring = wiring
        self.conditions = conditions
        self.order = order

    def describe(self) -> dict:
        return {
            "name": self.name,
            "description": self.spec.description,
            "inputs": dict(self.spec.inputs),
            "outputs": dict(self.spec.outputs),
            "nodes": [{"name": n, "kind": _kind(self.nodes[n]),
                       "after": sorted({r.node for r in self._reads(n)} - {INPUT})} for n in self.order],
        }

    def _is_tensor(self, node: str) -> bool:
        return hasattr(self.nodes.get(node), "shapes")  # a tensor model's node (its BYTES outputs are lists)

    def _reads(self, name: str) -> list[Ref]:
        refs = list(self.wiring[name].values())
        if name in self.conditions:
            refs.append(self.conditions[name][0])
        return refs

    async def run(self, inputs: dict) -> dict:
        """Run the DAG on one request item; returns {"outputs", "models"}."""
        if not isinstance(inputs, dict):
            raise InvalidInput(f"pipeline '{self.name}' takes an object with fields {sorted(self.spec.inputs)}")
        unknown = set(inputs) - set(self.spec.inputs)
        if unknown:
            raise InvalidInput(f"unknown input field(s) {sorted(unknown)}; pipeline '{self.name}' takes "
                               f"{sorted(self.spec.inputs)}", param=sorted(unknown)[0])
        for field, port_type in self.spec.inputs.items():
            if field not in inputs:
                raise InvalidInput(f"missing input field '{field}'", param=field)
            check_value(port_type, inputs[field], field)
        values: dict[str, dict | object] = {INPUT: inputs}
        tasks: dict[str, asyncio.Task] = {}

        def read(ref: Ref):
            got = values[ref.node]
            return SKIPPED if got is SKIPPED else got.get(ref.port)

        async def run_node(name: str) -> None:
            deps = {r.node for r in self._reads(name)} - {INPUT}
            await asyncio.gather(*(tasks[d] for d in deps))
            args = {port: read(ref) for port, ref in self.wiring[name].items()}
            skip = any(v is SKIPPED for v in args.values())
            if not skip and name in self.conditions:
                ref, allowed = self.conditions[name]
                value = read(ref)
                if value is not SKIPPED and (isinstance(value, np.ndarray) or
                                             (isinstance(value, list) and self._is_tensor(ref.node))):
                    value = _one_value(value, name, ref)
                skip = value is SKIPPED or value not in allowed
            values[name] = SKIPPED if skip else await self.nodes[name](args)

        # Tasks are created in topological order, so every dependency's task exists.
        for name in self.order:
            tasks[name] = asyncio.ensure_future(run_node(name))
        try:
            await asyncio.gather(*tasks.values())
        except BaseException:
            for t in tasks.values():
                t.cancel()
            raise
        outputs = {}
        for field, target in self.spec.outputs.items():
            value = read(_parse_ref(target))
            outputs[field] = None if value is SKIPPED else to_json(value)
        models = {}
        for name in self.order:
            got = values[name]
            if got is not SKIPPED and self.nodes[name].spec.model:
                models[self.nodes[name].spec.model] = got["version"]
        return {"outputs": outputs, "models": models}


def _one_value(value, node: str, ref: Ref):
    """A condition tests one value: a tensor of one element is tested as that element. A tensor of
    several (its dims are dynamic, or the load-time check could not know) fails this request."""
    flat = value.ravel() if isinstance(value, np.ndarray) else value
    if len(flat) != 1:
        shape = list(value.shape) if isinstance(value, np.ndarray) else [len(value)]
        raise Unprocessable(f"node '{node}': its condition input '{ref.node}.{ref.port}' is a tensor of shape "
                            f"{shape} for this request; a 'when' condition tests one value", param="when")
    one = flat[0]
    return one.item() if isinstance(one, np.generic) else one


def to_json(value):
    if isinstance(value, Embedding):
        return value.values.tolist()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return value


def _kind(node: Node) -> str:
    s = node.spec
    return f"model:{s.model}" if s.model else (f"function:{s.function}" if s.function else f"step:{s.step}")


def _parse_ref(text: str) -> Ref:
    node, dot, port = str(text).partition(".")
    if not dot or not node or not port:
        raise ValueError(f"expected 'node.output' or 'input.<field>', got {text!r}")
    return Ref(node, port)


async def load_pipeline(name: str, file: Path, registry) -> Pipeline:
    """Parse, check and prepare a pipeline; every problem is a ConfigError naming file and field."""
    file = Path(file).resolve()
    spec: PipelineFile = load_yaml_file(file, PipelineFile)
    index = {}
    for i, n in enumerate(spec.nodes):
        if n.name in index:
            raise ConfigError(f"{file}: field 'nodes[{i}].name': duplicate node name '{n.name}'", param="name")
        if n.name == INPUT:
            raise ConfigError(f"{file}: field 'nodes[{i}].name': '{INPUT}' is reserved for the request's inputs")
        index[n.name] = i
    nodes = {n.name: make_node(n, LoadContext(registry, file, f"nodes[{index[n.name]}]")) for n in spec.nodes}

    def resolve(ref_text: str, where: str) -> tuple[Ref, str]:
        err = lambda msg: ConfigError(f"{file}: field '{where}': {msg}", param=where)  # noqa: E731
        try:
            ref = _parse_ref(ref_text)
        except ValueError as exc:
            raise err(str(exc)) from None
        if ref.node == INPUT:
            if ref.port not in spec.inputs:
                raise err(f"the pipeline has no input '{ref.port}' (inputs: {', '.join(spec.inputs)})")
            return ref, spec.inputs[ref.port]
        if ref.node not in nodes:
            raise err(f"no node named '{ref.node}' (nodes: {', '.join(nodes)})")
        outs = nodes[ref.node].outputs
        if ref.port not in outs:
            raise err(f"node '{ref.node}' has no output '{ref.port}' (outputs: {', '.join(outs)})")
        return ref, outs[ref.port]

    wiring: dict[str, dict[str, Ref]] = {}
    conditions: dict[str, tuple[Ref, list]] = {}
    graph: dict[str, set[str]] = {}
    for n in spec.nodes:
        node, where = nodes[n.name], f"nodes[{index[n.name]}]"
        wiring[n.name] = {}
        for port, target in n.inputs.items():
            expected = node.inputs.get(port, node.variadic)
            if expected is None:
                raise ConfigError(f"{file}: field '{where}.inputs.{port}': node '{n.name}' has no input '{port}' "
                                  f"(inputs: {', '.join(node.inputs) or 'none'})", param=f"{where}.inputs.{port}")
            ref, got = resolve(target, f"{where}.inputs.{port}")
            if not compatible(got, expected):
                raise ConfigError(f"{file}: field '{where}.inputs.{port}': type mismatch: '{target}' is {got} "
                                  f"but input '{port}' of node '{n.name}' takes {expected}",
                                  param=f"{where}.inputs.{port}")
            wiring[n.name][port] = ref
        missing = node.required_inputs(set(n.inputs)) - set(n.inputs)
        embeds = n.model and {"text", "tokens"} <= set(node.inputs)  # tensor models have their own ports
        if embeds and len({"text", "tokens"} & set(n.inputs)) != 1:
            missing = {"text or tokens (exactly one)"}
        if node.variadic == "vector" and not n.inputs:
            missing = {"at least one vector"}
        if missing:
            raise ConfigError(f"{file}: field '{where}.inputs': node '{n.name}' is missing input(s) "
                              f"{', '.join(sorted(missing))}", param=f"{where}.inputs")
        if n.when is not None:
            ref, _ = resolve(n.when.input, f"{where}.when.input")
            dims = getattr(nodes.get(ref.node), "shapes", {}).get(ref.port)
            if dims is not None and -1 not in dims and math.prod(dims) != 1:
                # A tensor output that can never be one value: every request would fail at run time.
                raise ConfigError(f"{file}: field '{where}.when.input': '{n.when.input}' is a tensor of shape "
                                  f"{list(dims)} per item; a condition tests one value (a tensor of one element, "
                                  "a label, a number or a bool)", param=f"{where}.when.input")
            conditions[n.name] = (ref, list(n.when.in_))
        graph[n.name] = {r.node for r in list(wiring[n.name].values()) +
                         ([conditions[n.name][0]] if n.name in conditions else [])} - {INPUT}
    for field, target in spec.outputs.items():
        resolve(target, f"outputs.{field}")
    try:
        order = list(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as exc:
        cycle = " -> ".join(exc.args[1])
        raise ConfigError(f"{file}: field 'nodes': the pipeline has a cycle: {cycle}", param="nodes") from None
    pipeline = Pipeline(name, file, spec, nodes, wiring, conditions, order)
    for n in order:
        await nodes[n].prepare(_upstream_models(pipeline, n))
    return pipeline


def _upstream_models(p: Pipeline, name: str) -> set[str]:
    """Models whose vectors reach `name` (what its reference texts are embedded with)."""
    found, stack, seen = set(), [name], set()
    while stack:
        current = stack.pop()
        for ref in p.wiring[current].values():
            if ref.node == INPUT or ref.node in seen:
                continue
            seen.add(ref.node)
            spec = p.nodes[ref.node].spec
            if spec.model:
                found.add(spec.model)
            elif p.nodes[ref.node].outputs.get(ref.port) == "vector":
                stack.append(ref.node)
    return found


class PipelineSet:
    """The served pipelines, by name; errors of those that failed to load are kept."""

    def __init__(self, registry, root: Path | None = None):
        self.registry = registry
        self.root = root  # the repository: messages name files relative to it
        self.pipelines: dict[str, Pipeline] = {}
        self.errors: dict[str, str] = {}
        self.files: dict[str, Path] = {}

    async def load(self, name: str, file: Path) -> Pipeline:
        self.files[name] = Path(file)
        try:
            pipeline = await load_pipeline(name, file, self.registry)
        except ConfigError as exc:
            message = relative_paths(exc.message, self.root) if self.root else exc.message
            self.errors[name] = message
            raise ConfigError(message, param=exc.param) from None
        self.pipelines[name] = pipeline  # swapped in whole: requests see the old or the new one
        self.errors.pop(name, None)
        return pipeline

    async def reload(self, name: str) -> Pipeline:
        if name not in self.files:
            raise NotFound(f"pipeline '{shown(name)}' not found; available: {', '.join(sorted(self.files)) or 'none'}",
                           param="pipeline")
        return await self.load(name, self.files[name])

    def get(self, name: str) -> Pipeline:
        pipeline = self.pipelines.get(name)
        if pipeline is None:
            if name in self.errors:
                raise NotFound(f"pipeline '{name}' failed to load: {self.errors[name]}", param="pipeline")
            raise NotFound(f"pipeline '{shown(name)}' not found; available: {', '.join(sorted(self.pipelines)) or 'none'}",
                           param="pipeline")
        return pipeline
