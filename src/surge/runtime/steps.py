"""Pipeline node kinds: a model, the built-in steps, and user functions.

Every kind declares its input and output ports with types, so runtime/dag.py
can reject a wrong wiring when the pipeline is loaded rather than when a
request runs into it. A node processes one request item; concurrency comes from
running independent nodes (and items) at the same time, batching from the
model's own batcher.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

from surge.config import PipelineNode
from surge.errors import ConfigError, EngineError, InvalidInput, SurgeError
from surge.types import EmbedOptions


@dataclass(frozen=True)
class Embedding:
    """A vector with its provenance: steps that compare it against reference
    texts embed those with the very same model version and options."""

    values: np.ndarray  # float32 [dim]
    model: str | None
    version: str | None
    dimensions: int | None = None


@dataclass
class LoadContext:
    registry: object  # runtime.registry.ModelRegistry
    file: Path  # the pipeline.yaml (relative paths are resolved against its folder)
    where: str  # "nodes[i]" for messages

    def error(self, field: str, message: str) -> ConfigError:
        return ConfigError(f"{self.file}: field '{self.where}.{field}': {message}", param=f"{self.where}.{field}")

    def path(self, field: str, value) -> Path:
        if not isinstance(value, str):
            raise self.error(field, "expected a file path")
        path = Path(value).expanduser()
        path = path if path.is_absolute() else self.file.parent / path
        if not path.is_file():
            raise self.error(field, f"file {path} does not exist")
        return path


class Node:
    """Base of every node kind. `inputs`/`outputs`: port -> type."""

    inputs: dict[str, str] = {}
    outputs: dict[str, str] = {}
    variadic: str | None = None  # type of any extra input port (pool takes any number of vectors)
    optional: frozenset[str] = frozenset()

    def __init__(self, spec: PipelineNode, ctx: LoadContext):
        self.spec = spec

    def required_inputs(self, connected: set[str]) -> set[str]:
        return set(self.inputs) - set(self.optional)

    async def prepare(self, upstream_models: set[str]) -> None:
        """Load-time work (embedding reference texts) so the first request is not slow."""

    async def __call__(self, args: dict) -> dict:
        raise NotImplementedError


class ModelNode(Node):
    inputs = {"text": "text", "tokens": "tokens"}
    outputs = {"vector": "vector", "version": "label"}
    optional = frozenset({"text", "tokens"})

    def __init__(self, spec: PipelineNode, ctx: LoadContext):
        super().__init__(spec, ctx)
        self.registry = ctx.registry
        try:
            self.registry.get(spec.model, spec.version)
        except Exception as exc:
            raise ctx.error("model", getattr(exc, "message", str(exc))) from None
        extra = set(spec.params) - {"normalize", "dimensions"}
        if extra:
            raise ctx.error("params", f"unknown parameter(s) {sorted(extra)} for a model node (normalize, dimensions)")
        self.options = EmbedOptions(normalize=spec.params.get("normalize"), dimensions=spec.params.get("dimensions"))

    def required_inputs(self, connected: set[str]) -> set[str]:
        # exactly one of text and tokens; dag.py reports neither or both
        return set()

    async def __call__(self, args: dict) -> dict:
        service = self.registry.get(self.spec.model, self.spec.version)
        if args.get("text") is not None:
            result = await service.embed(texts=[args["text"]], options=self.options)
        else:
            result = await service.embed(token_ids=[list(args["tokens"])], options=self.options)
        vec = Embedding(result.vectors[0], result.model, result.version, self.options.dimensions)
        return {"vector": vec, "version": result.version}


class Tokenize(Node):
    inputs = {"text": "text"}
    outputs = {"tokens": "tokens", "count": "number"}

    def __init__(self, spec: PipelineNode, ctx: LoadContext):
        super().__init__(spec, ctx)
        from surge.runtime.tokenize import Tokenizer

        model = spec.params.get("model")
        if not model:
            raise ctx.error("params.model", "tokenize needs the model whose tokenizer it uses")
        try:
            svc = ctx.registry.get(model)
        except Exception as exc:
            raise ctx.error("params.model", getattr(exc, "message", str(exc))) from None
        s = svc.spec
        self.tok = Tokenizer(s.tokenizer_file, max_length=s.max_length, vocab_size=s.vocab_size, pad_id=s.pad_token_id)

    async def __call__(self, args: dict) -> dict:
        enc = self.tok.encode([args["text"]])[0]
        return {"tokens": [int(i) for i in enc.ids], "count": len(enc)}


class Normalize(Node):
    inputs = {"vector": "vector"}
    outputs = {"vector": "vector"}

    async def __call__(self, args: dict) -> dict:
        v: Embedding = args["vector"]
        x = v.values.astype(np.float64)
        return {"vector": Embedding((x / max(np.linalg.norm(x), 1e-12)).astype(np.float32), v.model, v.version,
                                    v.dimensions)}


class Pool(Node):
    """Combine any number of vectors (e.g. two models' embeddings) into one."""

    inputs = {}
    outputs = {"vector": "vector"}
    variadic = "vector"

    def __init__(self, spec: PipelineNode, ctx: LoadContext):
        super().__init__(spec, ctx)
        self.mode = spec.params.get("mode", "mean")
        if self.mode not in ("mean", "max"):
            raise ctx.error("params.mode", f"pool mode must be mean or max, got {self.mode!r}")

    async def __call__(self, args: dict) -> dict:
        vecs: list[Embedding] = [args[k] for k in sorted(args)]
        dims = {v.values.shape[0] for v in vecs}
        if len(dims) != 1:
            raise EngineError(f"node '{self.spec.name}': cannot pool vectors of different sizes {sorted(dims)}")
        stack = np.stack([v.values for v in vecs])
        out = stack.mean(0) if self.mode == "mean" else stack.max(0)
        models = {(v.model, v.version) for v in vecs}
        model, version = models.pop() if len(models) == 1 else (None, None)
        return {"vector": Embedding(out.astype(np.float32), model, version, vecs[0].dimensions)}


class _Reference(Node):
    """Compares a vector with reference texts embedded by the vector's own model version."""

    def __init__(self, spec: PipelineNode, ctx: LoadContext):
        super().__init__(spec, ctx)
        self.registry = ctx.registry
        self._matrices: dict[tuple, np.ndarray] = {}

    def texts(self) -> list[str]:
        raise NotImplementedError

    async def matrix(self, model: str | None, version: str | None, dimensions: int | None) -> np.ndarray:
        if model is None:
            raise EngineError(f"node '{self.spec.name}': its vector does not come from one model")
        key = (model, version, dimensions)
        mat = self._matrices.get(key)
        if mat is None:
            service = self.registry.get(model, version)
            result = await service.embed(texts=self.texts(), options=EmbedOptions(normalize=True, dimensions=dimensions))
            mat = self._matrices[key] = result.vectors.astype(np.float64)
            # Keep only the serving versions' matrices (a few KiB each).
            while len(self._matrices) > 4:
                self._matrices.pop(next(iter(self._matrices)))
        return mat

    async def prepare(self, upstream_models: set[str]) -> None:
        for model in upstream_models:
            service = self.registry.get(model)
            await self.matrix(service.name, service.version, None)

    async def similarities(self, v: Embedding) -> np.ndarray:
        mat = await self.matrix(v.model, v.version, v.dimensions)
        q = v.values.astype(np.float64)
        return mat @ (q / max(np.linalg.norm(q), 1e-12))


class Classify(_Reference):
    """Nearest prototype: the label whose example utterances are most similar.

    mode "prototype" compares with the normalized mean of each label's examples;
    "nearest" with each label's single most similar example.
    """

    inputs = {"vector": "vector"}
    outputs = {"label": "label", "score": "number", "scores": "json"}

    def __init__(self, spec: PipelineNode, ctx: LoadContext):
        super().__init__(spec, ctx)
        path = ctx.path("params.examples", spec.params.get("examples"))
        data = _read_yaml(path, ctx, "params.examples")
        data = data.get("intents", data) if isinstance(data, dict) else data
        if not isinstance(data, dict) or not data or not all(
            isinstance(v, list) and v and all(isinstance(t, str) and t.strip() for t in v) for v in data.values()
        ):
            raise ctx.error("params.examples", f"{path} must map each label to a non-empty list of utterances")
        self.labels = [str(k) for k in data]
        self.examples = [t for v in data.values() for t in v]
        self.owner = np.array([i for i, v in enumerate(data.values()) for _ in v])
        self.mode = spec.params.get("mode", "prototype")
        if self.mode not in ("prototype", "nearest"):
            raise ctx.error("params.mode", f"classify mode must be prototype or nearest, got {self.mode!r}")
        self.threshold = float(spec.params.get("threshold", -1.0))
        self.fallback = str(spec.params.get("fallback", "unknown"))

    def texts(self) -> list[str]:
        return self.examples

    async def matrix(self, model, version, dimensions) -> np.ndarray:
        key = (model, version, dimensions)
        if key in self._matrices:
            return self._matrices[key]
        examples = await super().matrix(model, version, dimensions)
        if self.mode == "prototype":
            protos = np.stack([examples[self.owner == i].mean(0) for i in range(len(self.labels))])
            protos /= np.linalg.norm(protos, axis=1, keepdims=True)
            self._matrices[key] = protos
            return protos
        return examples

    async def __call__(self, args: dict) -> dict:
        sims = await self.similarities(args["vector"])
        if self.mode == "nearest":
            sims = np.array([sims[self.owner == i].max() for i in range(len(self.labels))])
        best = int(np.argmax(sims))
        score = float(sims[best])
        label = self.labels[best] if score >= self.threshold else self.fallback
        return {"label": label, "score": score,
                "scores": {lab: round(float(s), 6) for lab, s in zip(self.labels, sims)}}


class TopK(_Reference):
    """The k passages most similar to the vector (cosine), best first."""

    inputs = {"vector": "vector"}
    outputs = {"ranking": "ranking", "best": "text", "score": "number"}

    def __init__(self, spec: PipelineNode, ctx: LoadContext):
        super().__init__(spec, ctx)
        path = ctx.path("params.passages", spec.params.get("passages"))
        data = _read_yaml(path, ctx, "params.passages")
        data = data.get("passages", data) if isinstance(data, dict) else data
        items = []
        for i, item in enumerate(data if isinstance(data, list) else []):
            if isinstance(item, str):
                item = {"id": str(i), "text": item}
            if not isinstance(item, dict) or not isinstance(item.get("text"), str):
                raise ctx.error("params.passages", f"{path}: passage {i} needs a 'text'")
            items.append({"id": str(item.get("id", i)), "text": item["text"]})
        if not items:
            raise ctx.error("params.passages", f"{path} must hold a list of passages")
        self.passages = items
        self.k = spec.params.get("k", 3)
        if not isinstance(self.k, int) or self.k < 1:
            raise ctx.error("params.k", f"k must be a positive integer, got {self.k!r}")

    def texts(self) -> list[str]:
        return [p["text"] for p in self.passages]

    async def __call__(self, args: dict) -> dict:
        sims = await self.similarities(args["vector"])
        order = np.argsort(-sims, kind="stable")[: self.k]
        ranking = [{**self.passages[i], "score": round(float(sims[i]), 6)} for i in order]
        return {"ranking": ranking, "best": ranking[0]["text"], "score": ranking[0]["score"]}


class Function(Node):
    """A user function 'package.module:function'; called with the inputs as keyword
    arguments (plus `params` when it takes them); returns a dict of its outputs."""

    variadic = "any"

    def __init__(self, spec: PipelineNode, ctx: LoadContext):
        super().__init__(spec, ctx)
        module_name, _, attr = spec.function.partition(":")
        if not module_name or not attr:
            raise ctx.error("function", f"expected 'package.module:function', got {spec.function!r}")
        try:
            fn = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise ctx.error("function", f"cannot import {spec.function!r}: {exc}") from None
        if not callable(fn):
            raise ctx.error("function", f"{spec.function!r} is not callable")
        if not spec.outputs:
            raise ctx.error("outputs", "a function node declares its outputs and their types")
        self.fn = fn
        self.outputs = dict(spec.outputs)
        self.takes_params = "params" in inspect.signature(fn).parameters

    async def __call__(self, args: dict) -> dict:
        kwargs = dict(args)
        if self.takes_params:
            kwargs["params"] = self.spec.params
        try:
            out = self.fn(**kwargs)
            if inspect.isawaitable(out):
                out = await out
        except SurgeError:
            raise
        except Exception as exc:  # a bug in user code: say where, keep the server up
            raise EngineError(f"node '{self.spec.name}': {self.spec.function} raised "
                              f"{type(exc).__name__}: {exc}") from exc
        if len(self.outputs) == 1 and not isinstance(out, dict):
            out = {next(iter(self.outputs)): out}
        missing = set(self.outputs) - set(out or {})
        if missing:
            raise EngineError(f"node '{self.spec.name}': {self.spec.function} returned no {sorted(missing)}")
        return out


BUILTIN_STEPS: dict[str, type[Node]] = {
    "tokenize": Tokenize,
    "normalize": Normalize,
    "pool": Pool,
    "classify": Classify,
    "topk": TopK,
}


def make_node(spec: PipelineNode, ctx: LoadContext) -> Node:
    if spec.model:
        from surge.runtime.tensor_steps import TensorModelNode, is_tensor_model

        if is_tensor_model(ctx.registry, spec):  # kinds onnx, torch, python: ports are its tensors
            return TensorModelNode(spec, ctx)
        return ModelNode(spec, ctx)
    if spec.function:
        return Function(spec, ctx)
    kind = BUILTIN_STEPS.get(spec.step)
    if kind is None:
        raise ctx.error("step", f"unknown step {spec.step!r}; built-in steps: {', '.join(BUILTIN_STEPS)}")
    return kind(spec, ctx)


def _read_yaml(path: Path, ctx: LoadContext, field: str):
    try:
        return yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise ctx.error(field, f"cannot read {path}: {exc}") from None


def check_value(port_type: str, value, name: str):
    """Request inputs are checked against the pipeline's declared input types."""
    if port_type == "text" and (not isinstance(value, str) or not value.strip()):
        raise InvalidInput(f"input '{name}' must be a non-empty string", param=name)
    if port_type == "tokens" and (not isinstance(value, list) or not value
                                  or not all(isinstance(i, int) and not isinstance(i, bool) for i in value)):
        raise InvalidInput(f"input '{name}' must be a non-empty list of token ids", param=name)
    if port_type == "number" and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise InvalidInput(f"input '{name}' must be a number", param=name)
    return value
