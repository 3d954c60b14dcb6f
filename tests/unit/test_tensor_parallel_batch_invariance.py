"""The tensor-parallel encoder on the CPU is batch invariant (batch_invariant, its default, as the torch
engine's): a sentence's hidden states and pooled vector are bit for bit the same alone and in any batch
(DESIGN.md), and still equal the unsplit model within the split tests' tolerance. Real rank processes over
gloo, as in serving; world 2 (one addition per element in the all-reduce) and world 4 (partials summed in
rank order: a ring all-reduce's order follows the message size, see the last test)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from surge.engines.encoder import forward_reference, position_ids
from surge.engines.tensor_parallel import Groups, TensorParallelEngine
from surge.engines.tp_cpu import ShardCpuEncoder
from surge.engines.tp_weights import random_shard, small_config
from surge.types import Encoded, TokenBatch
from tests.batch_moves import moved as _moved
from tests.conftest import cosine_rows

# lengths up to 120 tokens: several attention block sizes, and row counts across the GEMM kernels' switches
CFG = small_config(heads=8, hidden=64, intermediate=256, layers=2, vocab=1000, max_positions=128)
SEED = 77


def _items(rng, n: int) -> list[Encoded]:
    lengths = np.concatenate([[1, 2, 15, 16, 17, 120], rng.integers(1, 121, size=n - 6)])
    return [Encoded(rng.integers(0, CFG.vocab, int(k)), rng.integers(0, 2, int(k))) for k in lengths]


def _unsplit(batch: TokenBatch) -> np.ndarray:
    w = random_shard(CFG, SEED, 0, 1)
    t = lambda a: torch.from_numpy(np.asarray(a, dtype=np.int64))  # noqa: E731
    cu = [0] + np.cumsum(batch.lengths).tolist()
    with torch.inference_mode():
        return forward_reference(w, t(batch.input_ids), t(batch.token_type_ids),
                                 t(position_ids(batch.lengths, 0)), cu).numpy()


def _engine(world: int, **kw) -> TensorParallelEngine:
    e = TensorParallelEngine(world=world, threads=1, seed=SEED, max_batch=64, **kw)
    e.load(CFG)
    return e


@pytest.mark.parametrize("world,precision", [(2, "fp32"), (4, "fp32"), (2, "bf16")])
def test_every_sequence_alone_equals_itself_in_random_batches(world, precision):
    e = _engine(world, precision=precision)  # batch_invariant: the default
    try:
        assert e.opts.batch_invariant
        rng = np.random.default_rng()
        items = _items(rng, 70)  # batch_moves draws batches of up to 64
        run = lambda its: e.run(TokenBatch.pack(its))  # noqa: E731
        moved = _moved(run, items, rng, 4)
        assert not moved, f"world {world} {precision}: {len(moved)} of {len(items)} sequences moved with their batch"
        batch = TokenBatch.pack(items[:40])
        if precision == "fp32":
            np.testing.assert_allclose(run(items[:40]), _unsplit(batch), rtol=1e-4, atol=1e-4)
        else:  # bf16 weights and activations: within bf16's rounding of the FP32 model
            assert cosine_rows(run(items[:40]), _unsplit(batch)).min() >= 0.99
        padded = TokenBatch.pad(items[:9])  # a padded batch: its padding changes nothing either
        got = e.run(padded)[padded.attention_mask.astype(bool)]
        assert np.array_equal(got, run(items[:9]))
    finally:
        e.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_plain_linear_fallback_is_invariant_too(dtype):
    """fused=False (F.linear in calls of ROW_CHUNK rows: where oneDNN cannot pack the dtype), on one shard of
    two with no reduce: its partial sums do not move either."""
    enc = ShardCpuEncoder(random_shard(CFG, SEED, 1, 2).to("cpu", dtype), fused=False)
    assert enc.gemm_chunks == [8, 8, 8, 8]

    def run(its):
        b = TokenBatch.pack(its)
        return enc.run(b.input_ids, b.token_type_ids, position_ids(b.lengths, 0), b.lengths, None)

    rng = np.random.default_rng()
    assert not _moved(run, _items(rng, 70), rng, 3)


def test_without_the_setting_the_batch_moves_a_sequence():
    """The check above can fail: batch_invariant=False runs each GEMM on the whole batch's rows (F.linear in
    fp32 rounds a row apart between calls of 1, 2-15 and 16+ rows: the short sequences move)."""
    e = _engine(2, batch_invariant=False)
    try:
        assert not e.opts.batch_invariant
        rng = np.random.default_rng(0)
        moved = _moved(lambda its: e.run(TokenBatch.pack(its)), _items(rng, 64), rng, 2)
        assert moved
    finally:
        e.close()


def test_bundled_minilm_pooled_vectors_do_not_depend_on_the_batch(bundled_spec, reference_embed, sentences):
    """Through the loader (tensor_parallel=2, defaults otherwise): each sentence's pooled vector alone equals
    its vector inside batches of other sizes, neighbours and lengths; and matches transformers FP32."""
    from surge.config import EngineConfig
    from surge.engines.pooling import l2_normalize
    from surge.runtime.loader import build_worker

    worker = build_worker(bundled_spec, None, EngineConfig(engine="torch", tensor_parallel=2, threads=1,
                                                           warmup_shapes=[(2, 8)]))
    try:
        assert worker.engines.engines[0].opts.batch_invariant
        rng = np.random.default_rng()
        texts = [sentences[i] for i in rng.choice(len(sentences), 24, replace=False)]
        texts.append(" ".join(sentences[:6]))  # one long sequence: another attention block size
        items = worker.tokenizer.encode(texts)
        alone = np.concatenate([worker.compute([it]) for it in items])
        for n in (2, 5, 13, len(items)):
            for _ in range(2):
                at = rng.choice(len(items), n, replace=False)
                got = worker.compute([items[i] for i in at])
                same = [np.array_equal(got[j], alone[i]) for j, i in enumerate(at)]
                assert all(same), f"{same.count(False)} of {n} vectors moved in a batch of {n}"
        cos = cosine_rows(l2_normalize(alone), reference_embed(texts))
        assert cos.min() >= 0.99999, f"worst cosine {cos.min():.7f}"
    finally:
        worker.engines.close()


# ---------------------------------------------------------------- the all-reduce's order

def _sums(rank: int, world: int, port: int, queue) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    try:
        store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timedelta(seconds=60))
        groups = Groups(store, rank, world, torch.device("cpu"), 60.0)
        g = torch.Generator().manual_seed(rank)
        part = torch.randn(512, 64, generator=g) * torch.exp(3 * torch.randn(512, 64, generator=g))  # wide range
        out = {}
        for name, fn in (("all_reduce", groups.all_reduce), ("rank_order", groups.sum_in_rank_order)):
            whole = fn(part.clone())
            out[name] = [not torch.equal(fn(part[s:s + m].clone()), whole[s:s + m])
                         for m, s in ((1, 0), (7, 3), (64, 64), (200, 311))]
            out[name + "_bits"] = whole.numpy().tobytes()
    except Exception as exc:  # reported to the test, which fails on it at once
        out = f"{type(exc).__name__}: {exc}"
    queue.put((rank, out))


def test_partials_are_summed_in_rank_order_whatever_the_message_size():
    """gloo's ring all-reduce over 3 ranks adds an element's partials in an order set by where the element
    falls in the message: the same rows of a smaller message come out in other bits. The rank-order sum
    does not move them, and every rank holds the same bits."""
    import socket

    world = 3
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_sums, args=(r, world, port, queue), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    try:
        results = dict(queue.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert not [r for r in results.values() if isinstance(r, str)], results
    assert any(results[0]["all_reduce"]), "the plain all-reduce did not move a row here: the check shows nothing"
    for r in range(world):
        assert not any(results[r]["rank_order"])
        assert results[r]["rank_order_bits"] == results[0]["rank_order_bits"]
