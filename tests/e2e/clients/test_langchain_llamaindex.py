"""LangChain's OpenAIEmbeddings and LlamaIndex's OpenAIEmbedding / OpenAILikeEmbedding,
end to end against a real server, at their default settings and with the settings
the README documents. No network: tiktoken's BPE file comes from a PyPI package."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import numpy as np
import openai
import pytest

from tests.conftest import cosine_rows
from tests.e2e.clients.conftest import API_KEY, MODEL


def _cl100k_cache_dir() -> Path:
    """A TIKTOKEN_CACHE_DIR holding cl100k_base: llama-index-core ships one (tiktoken's own
    file name: the sha1 of its download URL), so LangChain's default path runs offline."""
    import llama_index.core

    return Path(llama_index.core.__file__).parent / "_static" / "tiktoken_cache"


@pytest.fixture
def tiktoken_offline(monkeypatch):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(_cl100k_cache_dir()))


def _short_texts(sentences, n: int) -> list[str]:
    words = " ".join(sentences[:60]).split()
    return [f"{words[i % len(words)]} {words[(5 * i + 3) % len(words)]} {i}" for i in range(n)]


def test_langchain_defaults_get_a_400_that_says_what_to_set(main_server, tiktoken_offline):
    from langchain_openai import OpenAIEmbeddings

    # Default settings: tiktoken cl100k ids are sent, which this model cannot read.
    emb = OpenAIEmbeddings(base_url=main_server.url + "/v1", api_key=API_KEY, max_retries=0)
    assert emb.model == "text-embedding-ada-002" and emb.check_embedding_ctx_length
    with pytest.raises(openai.BadRequestError) as err:
        emb.embed_documents(["turn on the kitchen lights"])
    assert "check_embedding_ctx_length=False" in str(err.value)


def test_langchain_documented_settings(main_server, reference_embed, sentences):
    from langchain_openai import OpenAIEmbeddings

    emb = OpenAIEmbeddings(model="text-embedding-3-small", base_url=main_server.url + "/v1", api_key=API_KEY,
                           check_embedding_ctx_length=False, max_retries=0)
    assert emb.chunk_size == 1000  # LangChain's default: 1,000 texts per request (surge takes up to 2,048)
    texts = _short_texts(sentences, 1004)  # two requests: 1,000 texts, then 4
    got = np.array(emb.embed_documents(texts), dtype=np.float32)
    assert got.shape == (1004, 384)
    pick = [0, 999, 1000, 1003]
    assert cosine_rows(got[pick], reference_embed([texts[i] for i in pick])).min() >= 0.99999
    query = "how do I reset my password?"
    assert cosine_rows(np.array([emb.embed_query(query)]), reference_embed([query]))[0] >= 0.99999
    docs = sentences[20:23]
    adocs = np.array(asyncio.run(emb.aembed_documents(docs)))
    assert cosine_rows(adocs, reference_embed(docs)).min() >= 0.99999


def test_langchain_long_documents_are_400_or_truncated_when_asked(main_server, reference_embed, sentences):
    from langchain_openai import OpenAIEmbeddings

    long = " ".join(sentences[:80])
    common = dict(model="text-embedding-3-small", base_url=main_server.url + "/v1", api_key=API_KEY,
                  check_embedding_ctx_length=False, max_retries=0)
    with pytest.raises(openai.BadRequestError) as err:
        OpenAIEmbeddings(**common).embed_documents([long])
    assert "input 0 has" in str(err.value) and "truncate" in str(err.value)
    emb = OpenAIEmbeddings(**common, model_kwargs={"extra_body": {"truncate": True}})
    got = np.array(emb.embed_documents([long]))
    assert cosine_rows(got, reference_embed([long]))[0] >= 0.99999


def test_langchain_default_path_offline_needs_the_bpe_file(main_server, monkeypatch, tmp_path):
    """What happens without a cached cl100k file and no network: tiktoken's download fails
    in the client before any request (documented in the README)."""
    from langchain_openai import OpenAIEmbeddings

    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))  # empty: nothing cached
    import tiktoken.registry

    monkeypatch.setattr(tiktoken.registry, "ENCODINGS", {})  # forget encodings loaded by other tests
    emb = OpenAIEmbeddings(base_url=main_server.url + "/v1", api_key=API_KEY, max_retries=0)
    try:
        emb.embed_documents(["hello"])
    except openai.BadRequestError:
        pytest.skip("this machine reached the internet: tiktoken downloaded its file")
    except Exception as exc:  # requests' ConnectionError (an OSError) from tiktoken's download
        assert isinstance(exc, OSError), repr(exc)
    else:
        raise AssertionError("expected a failure")


def test_llamaindex_openai_embedding_defaults_and_openai_like(main_server, reference_embed, sentences):
    from llama_index.embeddings.openai import OpenAIEmbedding
    from llama_index.embeddings.openai_like import OpenAILikeEmbedding

    texts = _short_texts(sentences, 104)  # more than embed_batch_size (100): two requests
    ref = reference_embed(texts)
    default = OpenAIEmbedding(api_base=main_server.url + "/v1", api_key=API_KEY, max_retries=0)
    assert default.model_name == "text-embedding-ada-002"  # its default name: served as an alias
    for emb in (default,
                OpenAIEmbedding(model="text-embedding-3-small", api_base=main_server.url + "/v1", api_key=API_KEY),
                OpenAILikeEmbedding(model_name=MODEL, api_base=main_server.url + "/v1", api_key=API_KEY)):
        got = np.array(emb.get_text_embedding_batch(texts), dtype=np.float32)
        assert cosine_rows(got, ref).min() >= 0.99999
        q = "what is the weather tomorrow"
        assert cosine_rows(np.array([emb.get_query_embedding(q)]), reference_embed([q]))[0] >= 0.99999
    got = np.array(asyncio.run(default.aget_text_embedding_batch(texts[:5])))
    assert cosine_rows(got, ref[:5]).min() >= 0.99999


def test_cl100k_file_is_the_one_tiktoken_wants():
    import hashlib

    name = hashlib.sha1(b"https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken").hexdigest()
    assert (_cl100k_cache_dir() / name).is_file(), os.listdir(_cl100k_cache_dir())


def test_langchain_chunks_long_documents_with_the_models_own_tokenizer(main_server, reference_embed, sentences):
    """LangChain's length-safe path, offline, with the served model's tokenizer instead of
    tiktoken: long documents are cut into chunks that fit the model and averaged."""
    from langchain_openai import OpenAIEmbeddings

    from surge.models import bundled_model_dir

    emb = OpenAIEmbeddings(model="text-embedding-3-small", base_url=main_server.url + "/v1", api_key=API_KEY,
                           tiktoken_enabled=False, tiktoken_model_name=str(bundled_model_dir()),
                           embedding_ctx_length=254, max_retries=0)  # 254 + [CLS] and [SEP] = the model's 256
    long, short = " ".join(sentences[:80]), sentences[5]
    got = np.array(emb.embed_documents([short, long]), dtype=np.float32)
    assert cosine_rows(got[:1], reference_embed([short]))[0] >= 0.99999
    tok = reference_embed.tok
    ids = tok.encode(long, add_special_tokens=False)
    chunks = [tok.decode(ids[i:i + 254]) for i in range(0, len(ids), 254)]
    assert len(chunks) >= 3
    ref = reference_embed(chunks)
    weights = np.array([len(ids[i:i + 254]) for i in range(0, len(ids), 254)], dtype=np.float64)
    mean = (ref * weights[:, None]).sum(0) / weights.sum()  # LangChain's weighted average, renormalized
    assert cosine_rows(got[1:], (mean / np.linalg.norm(mean))[None])[0] >= 0.9999
