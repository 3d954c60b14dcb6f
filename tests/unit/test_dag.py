"""DAG pipelines in-process, with the real bundled model behind a real ModelService:
load-time checks (cycles, missing inputs, type mismatches: file and field named),
concurrency of branches, conditions, and results against float64 math."""

from __future__ import annotations

import asyncio
import textwrap

import numpy as np
import pytest

from surge.errors import ConfigError, InvalidInput
from surge.runtime.dag import load_pipeline
from surge.runtime.registry import ModelRegistry
from surge.runtime.service import ModelService


@pytest.fixture
def registry(bundled_worker):
    """A registry with model 'enc'. A ModelService belongs to one event loop (its
    batcher runs there), so each test runs its body in one `serve(...)` call."""
    reg = ModelRegistry()
    reg.add(ModelService("enc", "1", bundled_worker))
    reg.get("enc").mark_ready()
    return reg


def serve(registry, body):
    """Run `await body()` in one event loop. The service is not closed: that would
    close the session-wide worker's engines that other tests share."""
    return asyncio.run(body())


def write(tmp_path, text: str, name="pipeline.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def load(path, registry):
    return asyncio.run(load_pipeline("p", path, registry))


GOOD = """
inputs: {query: text}
nodes:
  - {name: a, model: enc, inputs: {text: input.query}}
  - {name: n, step: normalize, inputs: {vector: a.vector}}
outputs: {vec: n.vector, version: a.version}
"""

BAD = [
    ("cycle", """
     inputs: {q: text}
     nodes:
       - {name: a, step: normalize, inputs: {vector: b.vector}}
       - {name: b, step: normalize, inputs: {vector: a.vector}}
     outputs: {v: a.vector}
     """, ["nodes", "cycle", "a -> b"]),
    ("missing input", """
     inputs: {q: text}
     nodes:
       - {name: a, model: enc, inputs: {text: input.q}}
       - {name: c, step: classify, params: {examples: ex.yaml}, inputs: {}}
     outputs: {v: c.label}
     """, ["nodes[1].inputs", "missing input", "vector"]),
    ("unknown node", """
     inputs: {q: text}
     nodes:
       - {name: a, step: normalize, inputs: {vector: nope.vector}}
     outputs: {v: a.vector}
     """, ["nodes[0].inputs.vector", "no node named 'nope'"]),
    ("unknown output", """
     inputs: {q: text}
     nodes:
       - {name: a, model: enc, inputs: {text: input.q}}
     outputs: {v: a.vectors}
     """, ["outputs.v", "no output 'vectors'"]),
    ("type mismatch", """
     inputs: {q: text}
     nodes:
       - {name: a, step: normalize, inputs: {vector: input.q}}
     outputs: {v: a.vector}
     """, ["nodes[0].inputs.vector", "type mismatch", "text", "vector"]),
    ("unknown model", """
     inputs: {q: text}
     nodes:
       - {name: a, model: gpt-9, inputs: {text: input.q}}
     outputs: {v: a.vector}
     """, ["nodes[0].model", "gpt-9"]),
    ("two kinds", """
     inputs: {q: text}
     nodes:
       - {name: a, model: enc, step: normalize, inputs: {text: input.q}}
     outputs: {v: a.vector}
     """, ["nodes[0]", "exactly one of model, step, function"]),
    ("unknown field", """
     inputs: {q: text}
     nodes:
       - {name: a, model: enc, input: {text: input.q}}
     outputs: {v: a.vector}
     """, ["nodes[0].input", "unknown field"]),
    ("bad type name", """
     inputs: {q: string}
     nodes:
       - {name: a, model: enc, inputs: {text: input.q}}
     outputs: {v: a.vector}
     """, ["inputs.q"]),
    ("unknown step", """
     inputs: {q: text}
     nodes:
       - {name: a, step: summarize, inputs: {text: input.q}}
     outputs: {v: a.x}
     """, ["nodes[0].step", "summarize", "classify"]),
    ("bad function", """
     inputs: {q: text}
     nodes:
       - {name: a, function: "surge.nope:f", inputs: {x: input.q}, outputs: {y: any}}
     outputs: {v: a.y}
     """, ["nodes[0].function", "cannot import"]),
    ("invalid yaml", "inputs: {q: text\nnodes: [", ["invalid YAML", "line"]),
    ("model without input", """
     inputs: {q: text}
     nodes:
       - {name: a, model: enc}
     outputs: {v: a.vector}
     """, ["nodes[0].inputs", "text or tokens"]),
]


@pytest.mark.parametrize("name,text,needles", BAD, ids=[b[0] for b in BAD])
def test_invalid_pipeline_names_file_and_field(tmp_path, registry, name, text, needles):
    (tmp_path / "ex.yaml").write_text("a: [x]\n")
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load(path, registry)
    msg = info.value.message
    assert str(path) in msg, msg
    for needle in needles:
        assert needle in msg, msg


def test_model_node_matches_reference(tmp_path, registry, reference_embed, sentences):
    async def body():
        p = await load_pipeline("p", write(tmp_path, GOOD), registry)
        for text in sentences[:3]:
            out = await p.run({"query": text})
            ref = reference_embed([text])[0].astype(np.float64)
            got = np.array(out["outputs"]["vec"])
            assert out["outputs"]["version"] == "1" and out["models"] == {"enc": "1"}
            assert np.dot(got, ref) / np.linalg.norm(ref) >= 0.99999
            assert abs(np.linalg.norm(got) - 1) < 1e-5
        with pytest.raises(InvalidInput, match="query"):
            await p.run({"query": ""})
        with pytest.raises(InvalidInput, match="unknown input"):
            await p.run({"query": "x", "other": 1})

    serve(registry, body)


SLOW = """
import asyncio, time
LOG = []
async def slow(x, params):
    LOG.append(("start", params["tag"], time.monotonic()))
    await asyncio.sleep(0.3)
    LOG.append(("end", params["tag"], time.monotonic()))
    return {"y": params["tag"]}
def pick(a, b):
    return {"both": [a, b]}
"""


def test_branches_run_concurrently_and_conditions_skip(tmp_path, registry, monkeypatch):
    (tmp_path / "userfns.py").write_text(SLOW)
    monkeypatch.syspath_prepend(str(tmp_path))
    path = write(tmp_path, """
    inputs: {q: text, mode: label}
    nodes:
      - {name: left, function: "userfns:slow", params: {tag: L}, inputs: {x: input.q}, outputs: {y: label}}
      - {name: right, function: "userfns:slow", params: {tag: R}, inputs: {x: input.q}, outputs: {y: label}}
      - {name: join, function: "userfns:pick", inputs: {a: left.y, b: right.y}, outputs: {both: json}}
      - name: gated
        model: enc
        inputs: {text: input.q}
        when: {input: input.mode, in: [embed]}
      - {name: after_gated, step: normalize, inputs: {vector: gated.vector}}
    outputs: {both: join.both, vec: after_gated.vector}
    """)
    async def body():
        p = await load_pipeline("p", path, registry)
        import userfns

        out = await p.run({"q": "hello", "mode": "skip"})
        assert out["outputs"] == {"both": ["L", "R"], "vec": None} and out["models"] == {}
        starts = {tag: t for kind, tag, t in userfns.LOG if kind == "start"}
        ends = {tag: t for kind, tag, t in userfns.LOG if kind == "end"}
        # Both branches started before either finished: they ran at the same time.
        assert max(starts.values()) < min(ends.values())
        out = await p.run({"q": "hello", "mode": "embed"})
        assert len(out["outputs"]["vec"]) == 384 and out["models"] == {"enc": "1"}

    serve(registry, body)


def test_tokenize_tokens_input_and_pool(tmp_path, registry, reference_embed):
    path = write(tmp_path, """
    inputs: {q: text}
    nodes:
      - {name: tok, step: tokenize, params: {model: enc}, inputs: {text: input.q}}
      - {name: by_ids, model: enc, inputs: {tokens: tok.tokens}, params: {normalize: false}}
      - {name: by_text, model: enc, inputs: {text: input.q}, params: {normalize: false}}
      - {name: both, step: pool, params: {mode: mean}, inputs: {a: by_ids.vector, b: by_text.vector}}
    outputs: {count: tok.count, ids: by_ids.vector, mean: both.vector}
    """)
    text = "set a timer for the pasta, twelve minutes"

    async def body():
        p = await load_pipeline("p", path, registry)
        return (await p.run({"q": text}))["outputs"]

    out = serve(registry, body)
    assert out["count"] == len(reference_embed.tok(text)["input_ids"])
    # The reference normalizes; compare directions in float64.
    ref = reference_embed([text])[0].astype(np.float64)
    for key in ("ids", "mean"):
        v = np.array(out[key], dtype=np.float64)
        assert v @ ref / np.linalg.norm(v) / np.linalg.norm(ref) >= 0.99999
    assert abs(np.linalg.norm(out["ids"]) - 1) > 1e-3  # normalize: false reached the model


def test_user_function_error_names_the_node(tmp_path, registry, monkeypatch):
    (tmp_path / "brokenfns.py").write_text("def boom(x):\n    raise KeyError('nope')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    path = write(tmp_path, """
    inputs: {q: text}
    nodes:
      - {name: f, function: "brokenfns:boom", inputs: {x: input.q}, outputs: {y: any}}
    outputs: {y: f.y}
    """)
    from surge.errors import EngineError

    async def body():
        p = await load_pipeline("p", path, registry)
        with pytest.raises(EngineError, match="node 'f': brokenfns:boom raised KeyError"):
            await p.run({"q": "hi"})

    serve(registry, body)
