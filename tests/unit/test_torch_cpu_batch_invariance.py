"""The torch engine's CPU path is batch invariant (batch_invariant, the default): a sentence's hidden
states are bit for bit the same alone and in any batch (DESIGN.md), in fp32 and bf16, at 1 and 2 threads."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from surge.engines.encoder_cpu import CpuEncoder, InvariantPlan
from surge.engines.encoder_weights import load_weights
from surge.engines.torch_gpu import TorchEngine
from surge.runtime.tokenize import Tokenizer
from surge.types import TokenBatch
from tests.batch_moves import moved as _moved


@pytest.fixture(scope="module")
def items(bundled_spec, sentences):
    """Every shipped sentence, and a few long sequences (several sentences joined: 65-300 tokens)."""
    tok = Tokenizer(bundled_spec.tokenizer_file, bundled_spec.max_length, bundled_spec.vocab_size,
                    bundled_spec.pad_token_id)
    joined = [" ".join(sentences[i:i + k]) for i, k in ((0, 4), (10, 7), (30, 12), (60, 3))]
    out = tok.encode(list(sentences) + joined)
    assert max(len(it.ids) for it in out) > 128
    return out


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_every_sentence_alone_equals_itself_in_random_batches(bundled_spec, items, precision, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        engine = TorchEngine(device="cpu", precision=precision, max_batch=64)  # batch_invariant: the default
        engine.load(bundled_spec.path)
        assert engine.batch_invariant and engine._cpu.invariant
        moved = _moved(lambda its: engine.run(TokenBatch.pack(its)), items, np.random.default_rng(), 10)
        engine.close()
    finally:
        torch.set_num_threads(before)
    assert not moved, f"{precision}, {threads} threads: {len(moved)} of {len(items)} sentences moved"


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_plain_linear_fallback_is_invariant_too(bundled_spec, items, dtype, threads):
    """fused=False (F.linear, eager: what a CPU or build without oneDNN's packed GEMMs for the dtype runs, where
    the test above then checks the same path), at 1 and 2 threads (bf16 at 1 thread moved sentences when its
    row counts came from the load-time probe)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _check_fallback(bundled_spec, items, dtype)
    finally:
        torch.set_num_threads(before)


def _check_fallback(bundled_spec, items, dtype):
    enc = CpuEncoder(load_weights(bundled_spec.path).to("cpu", dtype), fused=False, invariant=True)
    assert enc.gemm_chunks == [8, 8, 8, 8]

    def run(its):
        b = TokenBatch.pack(its)
        pos = np.concatenate([np.arange(len(it.ids)) for it in its])
        return enc.run(b.input_ids, b.token_type_ids, pos, b.lengths)

    rng = np.random.default_rng()
    pool = [items[int(i)] for i in rng.choice(len(items) - 4, 60, replace=False)] + items[-4:]
    assert not _moved(run, pool, rng, 5)


def test_without_the_setting_the_batch_moves_a_sentence(bundled_spec, items):
    """The check above can fail: batch_invariant=False keeps the batch's own layout (bucketed row
    counts, shared attention blocks), which rounds most sentences apart."""
    engine = TorchEngine(device="cpu", precision="fp32", max_batch=64, batch_invariant=False)
    engine.load(bundled_spec.path)
    moved = _moved(lambda its: engine.run(TokenBatch.pack(its)), items[:60], np.random.default_rng(0), 3)
    engine.close()
    assert len(moved) > 10


def test_invariant_plan_gives_each_sequence_its_own_block():
    lengths = np.array([5, 20, 64, 3, 70, 9, 16])
    plan = InvariantPlan(lengths, 16, 16)
    t = int(lengths.sum())
    assert plan.tokens == -(-t // 16) * 16 and plan.blocks == [16, 32, 64, 80]
    rows = torch.cat(plan.gathers)  # block position -> packed row (t: the zero row)
    block_of = np.concatenate([np.full(len(g), p) for g, p in zip(plan.gathers, plan.blocks)])
    first = np.concatenate([[0], np.cumsum([len(g) for g in plan.gathers])[:-1]])
    s = 0
    for n in lengths.tolist():
        at = plan.back[s:s + n].numpy()
        assert rows[at].tolist() == list(range(s, s + n))  # its rows come back where they were
        p = int(block_of[at[0]])
        g = plan.blocks.index(p)
        assert (at[0] - first[g]) % p == 0 and p == -(-n // 16) * 16  # offset 0 of a block sized by n alone
        s += n
    keys = sorted(int(k) for m in plan.masks for k in m[:, 0, 0].sum(-1))
    assert keys == sorted(lengths.tolist())  # each block's real keys: its own sequence's, nothing else
    assert int((rows == plan.tokens).sum()) == len(rows) - t  # the rest: padding (the zero row after the batch)
