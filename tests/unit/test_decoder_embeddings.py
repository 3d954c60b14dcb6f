"""Decoders served as embedding models (Qwen3-Embedding, e5-mistral): detected from their
sentence-transformers files, run by engines/decoder/embedder.py, pooled and normalized as
sentence-transformers does; sentence-transformers 5+'s files read; the dense causal attention against
float64."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from surge.config import EngineConfig  # noqa: E402
from surge.errors import ConfigError  # noqa: E402
from surge.models import bundled_model_dir, load_model_spec  # noqa: E402
from surge.models.decoder import is_decoder_dir  # noqa: E402
from surge.models.tasks import check_servable  # noqa: E402
from tests.decoder_models import build_embedding_model, build_model  # noqa: E402

SHAPES = {"qwen3": {}, "qwen2": {}, "mistral": {}}


@pytest.fixture(scope="module", params=sorted(SHAPES))
def embedder(request, tmp_path_factory):
    kind = request.param
    d = build_embedding_model(kind, tmp_path_factory.mktemp("emb_" + kind) / "m", seed=11,
                              num_hidden_layers=3, **SHAPES[kind])
    return kind, d


def _worker(d, **engine):
    from surge.runtime.loader import build_worker

    return build_worker(load_model_spec(d), None, EngineConfig(threads=1, **engine))


def _texts(sentences, n=24):
    # real sentences of every length, the longer ones cut at the model's 48 tokens, one of a single word
    picked = sorted(sentences, key=len)[::max(1, len(sentences) // n)][:n - 1]
    return picked + ["Hi"]


def test_decoder_embeddings_equal_sentence_transformers(embedder, sentences):
    """Every row of a packed batch (sequences sharing attention blocks, some cut at max_seq_length) equals
    sentence-transformers' FP32 embedding of the same text; each row alone gives its batch's row."""
    from sentence_transformers import SentenceTransformer

    from surge.engines.pooling import l2_normalize

    kind, d = embedder
    spec = load_model_spec(d)
    assert (spec.task, spec.pooling, spec.normalize) == ("embed", "last", True)
    assert spec.task_info.architecture.endswith("ForCausalLM") and not is_decoder_dir(d)
    worker = _worker(d)
    texts = _texts(sentences)
    items = worker.tokenizer.encode(texts)
    assert max(len(e) for e in items) == 48 and min(len(e) for e in items) <= 3
    assert all(e.ids[-1] == items[0].ids[-1] for e in items)  # the appended <|endoftext|> is what is pooled
    torch.manual_seed(0)
    ref = SentenceTransformer(str(d), device="cpu").encode(texts, convert_to_numpy=True, batch_size=7)
    got = worker.finish(worker.compute(items), _options())
    assert got.shape == ref.shape
    np.testing.assert_allclose(got, ref, atol=2e-5)
    assert np.abs(got - ref).max() < 0.1 * np.abs(ref).max()  # and not near zero everywhere
    for i in (0, 7, len(items) - 1):
        alone = l2_normalize(worker.compute([items[i]]))
        np.testing.assert_allclose(alone[0], got[i], atol=1e-6)


def _options():
    from surge.types import EmbedOptions

    return EmbedOptions()


def test_bf16_on_the_cpu_follows_fp32(embedder, sentences):
    kind, d = embedder
    texts = _texts(sentences, 8)
    fp32, bf16 = _worker(d), _worker(d, precision="bf16")
    a = fp32.finish(fp32.compute(fp32.tokenizer.encode(texts)), _options())
    b = bf16.finish(bf16.compute(bf16.tokenizer.encode(texts)), _options())
    cos = (a * b).sum(1)
    assert cos.min() > 0.99, cos


def test_causal_dense_attention_against_float64():
    """Packed sequences of 1-130 tokens (several per 64-token block, one longer than a block), grouped-query
    heads: each query sees its own sequence's keys up to itself, nothing else."""
    from surge.engines.decoder.attention import DenseMeta, causal_dense

    g = torch.Generator().manual_seed(5)
    for lens in ([3, 70, 1, 64, 17, 130, 9], [40], [5, 5, 5]):
        t = sum(lens)
        q, k, v = (torch.randn(t, h, 16, generator=g) for h in (8, 2, 2))
        got = causal_dense(q, k, v, DenseMeta(lens, "cpu"), 0.25)
        ref = torch.empty(t, 8, 16, dtype=torch.float64)
        s = 0
        for n in lens:
            qs, ks, vs = q[s:s + n].double(), k[s:s + n].double(), v[s:s + n].double()
            ks, vs = ks.repeat_interleave(4, dim=1), vs.repeat_interleave(4, dim=1)
            scores = torch.einsum("qhd,khd->hqk", qs, ks) * 0.25
            scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
            ref[s:s + n] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vs)
            s += n
        torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-5)


def test_sentence_transformers_5_files(tmp_path):
    """Directories written by sentence-transformers 5+ (its modules under new paths, `pooling_mode` one
    name): pooling and normalization read, for a decoder and for an encoder; several modes at once refused."""
    from sentence_transformers import SentenceTransformer, models

    d = build_model("qwen3", tmp_path / "lm", seed=2)
    st = SentenceTransformer(modules=[models.Transformer(str(d)), models.Pooling(64, pooling_mode="lasttoken"),
                                      models.Normalize()])
    st.save(str(tmp_path / "st"))
    kinds = [m["type"] for m in json.loads((tmp_path / "st" / "modules.json").read_text())]
    assert not any(k.endswith("models.Pooling") for k in kinds)  # the new paths are what is read here
    spec = load_model_spec(tmp_path / "st")
    assert (spec.task, spec.pooling, spec.normalize) == ("embed", "last", True)

    enc = tmp_path / "enc"
    shutil.copytree(bundled_model_dir(), enc)
    (enc / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.base.modules.transformer.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.sentence_transformer.modules.pooling.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.base.modules.normalize.Normalize"}]))
    (enc / "1_Pooling" / "config.json").write_text(json.dumps({"embedding_dimension": 384, "pooling_mode": "cls"}))
    spec = load_model_spec(enc)
    assert (spec.pooling, spec.normalize) == ("cls", True)
    (enc / "1_Pooling" / "config.json").write_text(json.dumps({"embedding_dimension": 384,
                                                              "pooling_mode": ["mean", "max"]}))
    with pytest.raises(ConfigError, match="pooling_mode"):
        load_model_spec(enc)


def test_a_decoder_without_pooling_files_is_a_generator(tmp_path):
    """A causal LM is served for generation; asking it for embeddings names what is missing."""
    d = build_model("qwen2", tmp_path / "lm", seed=1)
    assert is_decoder_dir(d) and load_model_spec(d).task == "generate"
    spec = load_model_spec(d, task="embed")
    with pytest.raises(ConfigError, match="pooling config"):
        check_servable(spec.task_info, spec.model_type, spec.path)


def test_right_padded_rows_equal_the_packed_batch(embedder):
    """The GPU's graph form (rows right-padded to a bucket, causal attention only): every real token's
    hidden state equals the packed batch's, whatever the padding after it."""
    from surge.engines.decoder.attention import PaddedMeta
    from surge.engines.decoder.embedder import DecoderEmbedder
    from surge.types import Encoded, TokenBatch

    _, d = embedder
    engine = DecoderEmbedder(threads=1)
    engine.load(d)
    rng = np.random.default_rng(3)
    rows = [rng.integers(2, engine.vocab_size, n) for n in (5, 16, 1, 11)]
    packed = engine.run(TokenBatch.pack([Encoded(r, np.zeros_like(r)) for r in rows]))
    width = 16
    ids = np.full((4, width), 7, dtype=np.int64)  # padding of a real token id: it must not matter
    for i, r in enumerate(rows):
        ids[i, :len(r)] = r
    with torch.inference_mode():
        hidden = engine.model.forward(torch.as_tensor(ids.reshape(-1)), torch.arange(width).repeat(4), None,
                                      PaddedMeta(4, width)).numpy()
    real = np.concatenate([i * width + np.arange(len(r)) for i, r in enumerate(rows)])
    np.testing.assert_allclose(hidden[real], packed, atol=1e-5)


def test_default_prompt_and_named_prompts(tmp_path, sentences):
    """config_sentence_transformers.json's default_prompt_name goes before every text, as sentence-transformers'
    encode puts it; a named prompt replaces it; the cache keeps prompted and plain answers apart."""
    import asyncio

    from sentence_transformers import SentenceTransformer

    from surge.runtime.service import ModelService
    from surge.types import EmbedOptions
    from tests.decoder_models import QWEN3_EMBEDDING_PROMPTS, build_embedding_model

    d = build_embedding_model("qwen3", tmp_path / "m", seed=8, max_seq_length=96, prompts=QWEN3_EMBEDDING_PROMPTS,
                              default_prompt_name="query")
    spec = load_model_spec(d)
    assert spec.default_prompt_name == "query" and spec.prompts == QWEN3_EMBEDDING_PROMPTS
    st = SentenceTransformer(str(d), device="cpu")
    texts = sentences[:3]
    service = ModelService(spec.name, "1", _worker(d))
    service.mark_ready()

    async def run():
        a = await service.embed(texts)
        b = await service.embed(texts, options=EmbedOptions(prompt_name="document"))
        c = await service.embed(texts)  # from the cache, the default prompt's entries
        return a, b, c

    by_default, document, again = asyncio.run(run())
    np.testing.assert_allclose(by_default.vectors, st.encode(texts), atol=2e-5)  # encode applies the default
    np.testing.assert_allclose(document.vectors, st.encode(texts, prompt_name="document"), atol=2e-5)
    assert np.abs(by_default.vectors - document.vectors).max() > 0.05
    assert all(again.cached) and np.array_equal(again.vectors, by_default.vectors)
    assert service.cached_result(texts).vectors.tolist() == by_default.vectors.tolist()


def test_optimize_refuses_decoders(embedder, tmp_path):
    """`surge optimize` on a decoder embedding model (or any decoder): a one-line error, not an export's traceback."""
    from typer.testing import CliRunner

    from surge.cli.main import app

    _, d = embedder
    result = CliRunner().invoke(app, ["optimize", str(d), "-o", str(tmp_path / "out")])
    assert result.exit_code == 1, result.output
    assert "is a decoder" in result.output and "surge serve" in result.output
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kind,labels", [("qwen3", ["negative", "neutral", "positive"]), ("llama", ["a", "b"]),
                                         ("qwen2", ["score"])])
def test_decoder_sequence_classifiers_equal_transformers(kind, labels, tmp_path, sentences):
    """`*ForSequenceClassification` decoders (classifiers; one label: a reranker, as Qwen3-Reranker's seq-cls
    form) served by the decoder embedder and the score head: every row of a packed batch = transformers' FP32
    logits, pooled where transformers pools (the last token that is not padding: here the tokenizer's appended
    <|endoftext|> is the padding token, so the token before it)."""
    from transformers import AutoModelForSequenceClassification

    from tests.decoder_models import build_decoder_classifier

    d = build_decoder_classifier(kind, tmp_path / "m", labels, seed=5)
    spec = load_model_spec(d)
    assert spec.task == ("rerank" if len(labels) == 1 else "classify") and spec.labels == tuple(labels)
    assert not is_decoder_dir(d)
    worker = _worker(d)
    texts = _texts(sentences, 10)
    tok = worker.tokenizer
    items = tok.encode(texts)
    if len(labels) == 1:  # a reranker reads (query, document) pairs
        items = tok.to_encoded(tok.encodings([(a, b) for a, b in zip(texts[5:], texts[:5])]))
    rows = worker.compute(items)
    model = AutoModelForSequenceClassification.from_pretrained(d, dtype=torch.float32).eval()
    pad = model.config.pad_token_id
    assert all(e.ids[-1] == pad for e in items)  # the pooled token is not the last one
    for e, row in zip(items, rows):
        with torch.no_grad():
            ref = model(torch.tensor([e.ids])).logits[0].numpy()
        np.testing.assert_allclose(row[:len(labels)], ref, atol=5e-5)


def test_last_real_token_positions():
    """Packed and padded batches: the last position whose id is not padding, the first when all are."""
    from surge.engines.heads import last_real
    from surge.types import Encoded, TokenBatch

    seqs = [np.array([5, 6, 0]), np.array([7]), np.array([0, 0]), np.array([3, 0, 4])]
    items = [Encoded(s, np.zeros_like(s)) for s in seqs]
    assert last_real(TokenBatch.pack(items), 0).tolist() == [1, 3, 4, 8]
    assert last_real(TokenBatch.pack(items), None).tolist() == [2, 3, 5, 8]
    assert last_real(TokenBatch.pad(items, pad_id=0), 0).tolist() == [1, 3, 6, 11]


def test_token_classification_on_a_decoder_is_refused(tmp_path):
    d = build_model("qwen2", tmp_path / "lm", seed=1)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(architectures=["Qwen2ForTokenClassification"], id2label={"0": "O", "1": "B-X"})
    (d / "config.json").write_text(json.dumps(cfg))
    spec = load_model_spec(d)
    with pytest.raises(ConfigError, match="token classification on a decoder"):
        check_servable(spec.task_info, spec.model_type, spec.path)


@pytest.mark.parametrize("extra", [{"auto_map": {"AutoModel": "modeling_qwen.Qwen2Model"}}, {"is_causal": False}])
def test_custom_or_bidirectional_layers_are_refused(tmp_path, extra):
    """A checkpoint trained with layers other than transformers' causal ones (gte-Qwen2's custom bidirectional
    code) fails the start with the reason, rather than serving wrong vectors."""
    from surge.engines.decoder.embedder import DecoderEmbedder

    d = build_embedding_model("qwen2", tmp_path / "m", seed=1)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, **extra}))
    with pytest.raises(ConfigError, match="auto_map|is_causal"):
        DecoderEmbedder().load(d)


@pytest.mark.parametrize("kind", ["qwen3", "qwen2", "llama", "mistral", "granite"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_torchscript_forward_equals_the_eager_layers(kind, precision, tmp_path):
    """The CPU's one-call TorchScript forward (embed_cpu.py) against the eager layers (model.py) on every layer kind
    (q/k norms, q/k/v biases, Granite's folded multipliers and biases): packed batches of several sequences and a
    lone one."""
    from surge.engines.decoder.embedder import DecoderEmbedder
    from surge.types import Encoded, TokenBatch

    d = build_embedding_model(kind, tmp_path / "m", seed=3)
    scripted, eager = DecoderEmbedder(precision=precision), DecoderEmbedder(precision=precision, cpu_script=False)
    scripted.load(d)
    eager.load(d)
    assert scripted._script is not None and eager._script is None
    rng = np.random.default_rng(1)
    for lens in ((7, 30, 1, 64, 12), (9,)):
        rows = [rng.integers(2, scripted.vocab_size, n) for n in lens]
        batch = TokenBatch.pack([Encoded(r, np.zeros_like(r)) for r in rows])
        a, b = scripted.run(batch), eager.run(batch)
        tol = 1e-5 if precision == "fp32" else 2e-2
        np.testing.assert_allclose(a, b, atol=tol * max(1.0, float(np.abs(b).max())))
