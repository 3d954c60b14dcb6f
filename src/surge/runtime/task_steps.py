"""Pipeline nodes for task models: a `model:` node whose model classifies, reranks or tags.

  classify        inputs  text                      outputs label (label), score (number), scores (json)
  token-classify  inputs  text                      outputs entities (json); params aggregation_strategy,
                                                    ignore_labels
  rerank          inputs  text (the query),         outputs ranking (ranking, best first, each passage with
                          ranking (e.g. a topk's)           its "rerank_score"), best (text), score (number)

Every node also outputs `version`. Scores are what the HTTP routes report (softmax / sigmoid).
"""

from __future__ import annotations

from surge.engines.heads import scores as head_scores
from surge.engines.heads import sigmoid
from surge.errors import InvalidInput
from surge.runtime.entities import EntityDecoder, check_strategy
from surge.runtime.steps import LoadContext, Node
from surge.runtime.tasks import TaskRequest


class TaskModelNode(Node):
    optional = frozenset({"text", "tokens"})

    def __init__(self, spec, ctx: LoadContext, served):
        super().__init__(spec, ctx)
        self.registry = ctx.registry
        self.task = served.task
        allowed = {"aggregation_strategy", "ignore_labels"} if self.task == "token-classify" else set()
        extra = set(spec.params) - allowed
        if extra:
            raise ctx.error("params", f"unknown parameter(s) {sorted(extra)} for a {self.task} model node"
                            + (f" ({', '.join(sorted(allowed))})" if allowed else ""))
        self.inputs = {"text": "text"}
        if self.task == "classify":
            self.outputs = {"label": "label", "score": "number", "scores": "json", "version": "label"}
        elif self.task == "token-classify":
            self.outputs = {"entities": "json", "version": "label"}
            try:
                self.strategy = check_strategy(spec.params.get("aggregation_strategy"))
            except InvalidInput as exc:
                raise ctx.error("params.aggregation_strategy", exc.message) from None
            self.ignore = spec.params.get("ignore_labels")
        elif self.task == "rerank":
            self.inputs = {"text": "text", "ranking": "ranking"}
            self.outputs = {"ranking": "ranking", "best": "text", "score": "number", "version": "label"}
        else:
            raise ctx.error("model", f"model '{spec.model}' serves task '{self.task}', which a pipeline node "
                            "cannot call")

    def required_inputs(self, connected: set[str]) -> set[str]:
        return {"ranking"} if self.task == "rerank" else set()

    async def __call__(self, args: dict) -> dict:
        served = self.registry.get(self.spec.model, self.spec.version)
        text = args["text"]
        if self.task == "rerank":
            ranking = list(args["ranking"] or [])
            if not ranking:
                return {"ranking": [], "best": None, "score": None, "version": served.version}
            res = await served.infer(TaskRequest(pairs=[(text, p["text"]) for p in ranking], truncate=True))
            sc = [float(sigmoid(o.reshape(-1)[0])) for o in res.outputs]
            order = sorted(range(len(ranking)), key=lambda i: -sc[i])
            out = [{**ranking[i], "rerank_score": round(sc[i], 6)} for i in order]
            return {"ranking": out, "best": out[0]["text"], "score": out[0]["rerank_score"], "version": res.version}
        res = await served.infer(TaskRequest(texts=[text], truncate=True))
        if self.task == "classify":
            p = head_scores(res.head, res.outputs[0])
            k = int(p.argmax())
            return {"label": res.head.labels[k], "score": float(p[k]),
                    "scores": {label: float(v) for label, v in zip(res.head.labels, p)}, "version": res.version}
        decoder = EntityDecoder(served.worker.tokenizer.backend)
        ents = decoder.entities(text, res.encodings[0], res.outputs[0], res.head.labels, self.strategy, self.ignore)
        return {"entities": ents, "version": res.version}
