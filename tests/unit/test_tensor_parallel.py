"""Tensor parallelism on the CPU (gloo): a split model's outputs equal the unsplit model's.

Real rank processes (spawned, as in serving), real collectives; the reference
is the unsplit model through the plain reference path (world 1 = the whole
model) and, for the bundled MiniLM, transformers in FP32 on real sentences.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from surge.engines.encoder import forward_reference, position_ids
from surge.engines.encoder_weights import load_weights
from surge.engines.tensor_parallel import TensorParallelEngine
from surge.engines.tp_weights import (load_shard, parameter_count, random_shard, shard_weights, small_config,
                                      xlmr_xl_config)
from surge.errors import ConfigError, EngineError, InvalidInput
from surge.types import Encoded, Layout, TokenBatch
from tests.conftest import cosine_rows

CFG = small_config(heads=8, hidden=64, intermediate=256, layers=2, vocab=1000)
SEED = 1234


def _batch(rng, n: int, vocab: int, layout: Layout = Layout.PACKED) -> TokenBatch:
    lengths = rng.integers(1, 40, size=n)
    items = [Encoded(rng.integers(0, vocab, size=int(k)), rng.integers(0, 2, size=int(k))) for k in lengths]
    return TokenBatch.pack(items) if layout is Layout.PACKED else TokenBatch.pad(items)


def _unsplit(batch: TokenBatch) -> np.ndarray:
    """The whole random model through encoder.forward_reference (no TP code at all)."""
    w = random_shard(CFG, SEED, 0, 1)
    ids = batch.input_ids if batch.layout is Layout.PACKED else batch.input_ids[batch.attention_mask.astype(bool)]
    types = batch.token_type_ids if batch.layout is Layout.PACKED else \
        batch.token_type_ids[batch.attention_mask.astype(bool)]
    t = lambda a: torch.from_numpy(np.asarray(a, dtype=np.int64))  # noqa: E731
    cu = [0] + np.cumsum(batch.lengths).tolist()
    with torch.inference_mode():
        return forward_reference(w, t(ids), t(types), t(position_ids(batch.lengths, 0)), cu).numpy()


@pytest.fixture(scope="module", params=[2, 4])
def tp_random(request):
    e = TensorParallelEngine(world=request.param, threads=1, seed=SEED, max_batch=16)
    e.load(CFG)
    yield e
    procs = list(e._procs)
    e.close()
    assert all(p.exitcode is not None for p in procs), "rank processes outlived close()"


@pytest.mark.parametrize("layout", [Layout.PACKED, Layout.PADDED])
def test_split_random_model_equals_unsplit(tp_random, layout):
    rng = np.random.default_rng()
    for n in (1, 5, 16):
        batch = _batch(rng, n, CFG.vocab, layout)
        got = tp_random.run(batch)
        if layout is Layout.PADDED:
            assert got.shape == batch.input_ids.shape + (CFG.hidden,)
            assert not got[~batch.attention_mask.astype(bool)].any()
            got = got[batch.attention_mask.astype(bool)]
        np.testing.assert_allclose(got, _unsplit(batch), rtol=1e-4, atol=1e-4)


def test_bad_input_stops_at_rank0_and_ranks_stay_in_step(tp_random):
    rng = np.random.default_rng()
    bad = _batch(rng, 3, CFG.vocab)
    bad.input_ids[2] = CFG.vocab + 7
    with pytest.raises(InvalidInput, match="token ids"):
        tp_random.run(bad)
    with pytest.raises(InvalidInput, match="max_batch"):
        tp_random.run(_batch(rng, 17, CFG.vocab))
    good = _batch(rng, 4, CFG.vocab)
    np.testing.assert_allclose(tp_random.run(good), _unsplit(good), rtol=1e-4, atol=1e-4)


def test_concurrent_callers_get_their_own_rows(tp_random):
    rng = np.random.default_rng()
    batches = [_batch(rng, int(rng.integers(1, 6)), CFG.vocab) for _ in range(8)]
    results: dict[int, np.ndarray] = {}

    def call(i):
        results[i] = tp_random.run(batches[i])

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(batches))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for i, b in enumerate(batches):
        np.testing.assert_allclose(results[i], _unsplit(b), rtol=1e-4, atol=1e-4)


def test_profile_reports_compute_and_allreduce(tp_random):
    batch = _batch(np.random.default_rng(), 2, CFG.vocab)
    p = tp_random.profile(batch, iters=3)
    assert p["world"] == tp_random.world and p["allreduces"] == 2 * CFG.layers
    assert p["total_ms"] > 0 and p["compute_ms"] > 0 and p["allreduce_ms"] > 0
    assert p["allreduce_bytes"] == batch.real_tokens * CFG.hidden * 4
    # the engine still answers correctly after profiling
    np.testing.assert_allclose(tp_random.run(batch), _unsplit(batch), rtol=1e-4, atol=1e-4)


def test_world_one_is_the_unsplit_model():
    e = TensorParallelEngine(world=1, seed=SEED)
    e.load(CFG)
    batch = _batch(np.random.default_rng(), 3, CFG.vocab)
    np.testing.assert_allclose(e.run(batch), _unsplit(batch), rtol=1e-5, atol=1e-5)
    assert e.profile(batch, iters=2)["allreduce_ms"] == 0
    e.close()


def test_bundled_minilm_split_two_ways_through_the_loader(bundled_spec, reference_embed, sentences):
    """build_worker with tensor_parallel=2 on the CPU: real sentences, pooled, against transformers FP32."""
    from surge.config import EngineConfig
    from surge.engines.torch_gpu import TorchEngine
    from surge.runtime.loader import build_worker
    from surge.engines.pooling import l2_normalize

    worker = build_worker(bundled_spec, None, EngineConfig(engine="torch", tensor_parallel=2, threads=1,
                                                           warmup_shapes=[(2, 8)]))
    try:
        engine = worker.engines.engines[0]
        assert isinstance(engine, TensorParallelEngine) and engine.world == 2
        rng = np.random.default_rng()
        texts = [sentences[i] for i in rng.choice(len(sentences), 24, replace=False)]
        items = worker.tokenizer.encode(texts)
        cos = cosine_rows(l2_normalize(worker.compute(items)), reference_embed(texts))
        assert cos.min() >= 0.99999, f"worst cosine {cos.min():.7f}"
        # hidden states against the unsplit reference path (the single-process torch engine)
        single = TorchEngine(device="cpu", precision="fp32", max_batch=64)
        single.load(bundled_spec.path)
        batch = TokenBatch.pack(items)
        np.testing.assert_allclose(engine.run(batch), single.run(batch), rtol=1e-4, atol=1e-4)
    finally:
        worker.engines.close()


def test_a_split_that_does_not_divide_is_a_config_error():
    with pytest.raises(ConfigError, match="split 3 ways"):
        TensorParallelEngine(world=3).load(CFG)


def test_ranks_that_cannot_load_give_a_clear_error_and_no_orphans(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "bert", "hidden_size": 64, "num_attention_heads": 8, '
                                          '"num_hidden_layers": 1, "intermediate_size": 128, "vocab_size": 100}')
    e = TensorParallelEngine(world=2, threads=1)
    with pytest.raises(ConfigError, match="safetensors"):  # found before any rank starts
        e.load(tmp_path)
    assert e._procs == []
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header")
    with pytest.raises(EngineError, match="shard"):
        e.load(tmp_path)
    assert e._procs == []  # close() ran: the rank process was joined or killed
    with pytest.raises(EngineError, match="not loaded"):
        e.run(_batch(np.random.default_rng(), 1, 100))


# ---------------------------------------------------------------- shards, no processes

def test_hf_shards_are_the_split_of_the_full_weights(bundled_spec):
    full = load_weights(bundled_spec.path)
    for world in (2, 4):
        for rank in range(world):
            got, want = load_shard(bundled_spec.path, rank, world), shard_weights(full, rank, world)
            for a, b in zip(got.embedding_tensors(), want.embedding_tensors()):
                assert torch.equal(a, b)
            for la, lb in zip(got.layers, want.layers):
                assert la.heads == lb.heads == 12 // world
                assert all(torch.equal(a, b) for a, b in zip(la.tensors(), lb.tensors()))


def test_random_shards_do_not_depend_on_the_world_size():
    whole = random_shard(CFG, SEED, 0, 1)
    for world in (2, 4, 8):
        for rank in range(world):
            got, want = random_shard(CFG, SEED, rank, world), shard_weights(whole, rank, world)
            for la, lb in zip(got.layers, want.layers):
                assert all(torch.equal(a, b) for a, b in zip(la.tensors(), lb.tensors()))
    assert not torch.equal(random_shard(CFG, SEED + 1, 0, 1).layers[0].wqkv, whole.layers[0].wqkv)


def test_xl_class_shape():
    cfg = xlmr_xl_config()
    assert 3.4e9 < parameter_count(cfg) < 3.6e9
    assert cfg.head_dim == 80 and cfg.intermediate % cfg.heads == 0


def test_torchrun_launch():
    """Ranks started by torchrun instead of spawned: rank 0 attaches with launcher="env"."""
    import os
    import signal
    import socket
    import subprocess
    import sys
    from pathlib import Path

    with socket.socket() as sock:  # torchrun wants a real port (0 does not reach the ranks)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    script = Path(__file__).with_name("tp_torchrun_main.py")
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                             "--master-addr", "127.0.0.1", "--master-port", str(port), str(script)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its ranks
        out, err = proc.communicate()
    assert proc.returncode == 0 and "TORCHRUN-OK" in out, out[-2000:] + err[-2000:]
