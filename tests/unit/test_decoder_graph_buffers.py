"""The CUDA-graph decode path's host logic on the CPU: static buffers, padded buckets, rows whose
input token is gathered from the previous step's output (overlapped steps), ring-buffered
staging sets. The graphs are "replayed" by running the captured function eagerly, and attention reads
the lengths and block tables from the buffers as the Triton kernel does; tokens must equal the
plain eager engine's while the batch shrinks through smaller buckets."""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from surge.engines.decoder import DecoderEngine  # noqa: E402
from surge.runtime.scheduler import SamplingParams, Scheduler, SchedulerConfig, Sequence  # noqa: E402
from surge.runtime.scheduler.overlap import StepLoop  # noqa: E402
from tests.decoder_models import build_model  # noqa: E402
from tests.loop_driver import drive  # noqa: E402


class _Replay:
    def __init__(self, graphs, b, lora=False):
        self.graphs, self.b, self.lora = graphs, b, lora

    def replay(self):
        outputs = self.graphs.outputs_lora if self.lora else self.graphs.outputs
        outputs[self.b] = self.graphs._forward(self.b, self.lora)


def _host_graphs(engine, max_num_seqs, steps=1):
    from surge.engines.decoder import model as model_mod
    from surge.engines.decoder.graphs import DecodeGraphs

    g = DecodeGraphs(engine, max_num_seqs, steps=steps)
    g.graphs = {b: _Replay(g, b) for b in g.buckets}
    g.outputs = {}
    if engine.model.lora is not None:
        g.graphs_lora = {b: _Replay(g, b, lora=True) for b in g.buckets}
    engine.graphs = g
    plain = model_mod.paged_attention_torch

    def from_buffers(q, k_cache, v_cache, meta, scale):  # what the kernel reads: device tensors only
        qs = meta.query_start.tolist()
        meta = dataclasses.replace(meta, q_lens=[b - a for a, b in zip(qs, qs[1:])],
                                   ctx_lens=meta.context_lens.tolist(), tables=meta.block_tables.tolist())
        return plain(q, k_cache, v_cache, meta, scale)

    return from_buffers


def _run(engine, prompts, lens, overlap, depth=1):
    sched = Scheduler(SchedulerConfig(num_blocks=engine.num_blocks, block_size=engine.block_size, max_num_seqs=6,
                                      max_num_batched_tokens=64, max_model_len=128), ())
    seqs = [Sequence(i, p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
            for i, (p, n) in enumerate(zip(prompts, lens))]
    for s in seqs:
        sched.add(s)
    loop = StepLoop(sched, engine, overlap=overlap, depth=depth)
    while loop.busy:
        loop.step()
        sched.blocks.check()
    return [s.output_ids for s in seqs], loop.overlapped


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_graph_buffers_and_device_gathered_inputs(tmp_path, monkeypatch, depth):
    """With 1 to 3 launched steps in flight (the staging sets used in turn)."""
    torch.set_num_threads(1)
    d = build_model("qwen2", tmp_path / "q", seed=2)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 300, (int(n),), generator=g).tolist() for n in (3, 17, 9, 30, 5, 12, 21, 8)]
    lens = [4, 19, 11, 7, 25, 2, 13, 9]  # sequences leave at different steps: the batch shrinks bucket by bucket
    want, _ = _run(DecoderEngine(d, num_blocks=96, block_size=4), prompts, lens, overlap=False)
    engine = DecoderEngine(d, num_blocks=96, block_size=4, max_num_seqs=6)
    from surge.engines.decoder import model as model_mod

    monkeypatch.setattr(model_mod, "paged_attention_torch", _host_graphs(engine, 6))
    got, overlapped = _run(engine, prompts, lens, overlap=True, depth=depth)
    assert got == want
    assert overlapped > 10
    got_sync, _ = _run(engine, prompts, lens, overlap=False)  # the graph path without overlap
    assert got_sync == want


@pytest.mark.parametrize("kind,depth,steps,cap", [("qwen2", 2, 3, None), ("gpt2", 1, 4, None), ("qwen2", 3, 5, None),
                                                  ("qwen2", 2, 5, 2)])
def test_multi_step_launches_equal_transformers(tmp_path, monkeypatch, kind, depth, steps, cap):
    """Launches of several decode steps through the graph path (each replay writes the next one's
    positions, slots, context lengths and source rows into the buffers; blocks reserved for the whole
    launch) give transformers' greedy tokens, with sequences joining at different steps, stop tokens
    found inside a launch, and max_tokens that are not multiples of the launch. `cap`: decode_launch_ms
    and the buckets' step times allow that many steps a launch, and no launch runs more."""
    from transformers import AutoModelForCausalLM

    from surge.engines.decoder import model as model_mod

    torch.set_num_threads(1)
    d = build_model(kind, tmp_path / kind, seed=2)
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 300, (int(n),), generator=g).tolist() for n in (3, 17, 9, 30, 5, 12)]
    lens = [11, 19, 7, 14, 23, 9]
    refs = [hf.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                        pad_token_id=0)[0, len(p):].tolist() for p, n in zip(prompts, lens)]
    engine = DecoderEngine(d, num_blocks=96, block_size=4, max_num_seqs=6)
    monkeypatch.setattr(model_mod, "paged_attention_torch", _host_graphs(engine, 6, steps=steps))
    launched = []
    if cap is not None:  # as if the buckets had measured 1.5 ms a step: 3.2 ms a launch allows 2
        engine.decode_launch_ms = 1.5 * cap + 0.2
        engine.graphs.step_us = {b: 1500.0 for b in engine.graphs.buckets}
        launch = engine.launch
        monkeypatch.setattr(engine, "launch", lambda s, prev, n=1: launched.append(n) or launch(s, prev, n))
    sched = Scheduler(SchedulerConfig(num_blocks=96, block_size=4, max_num_seqs=6, max_num_batched_tokens=64,
                                      max_model_len=128), ())
    # sequences 1 and 4 stop at the token they would produce 6th / 10th: found inside a launch
    stop_at = {1: 5, 4: 9}
    seqs = [Sequence(i, p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True,
                                          stop_token_ids=(refs[i][stop_at[i]],) if i in stop_at else ()))
            for i, (p, n) in enumerate(zip(prompts, lens))]
    arrivals = [0, 0, 2, 2, 7, 13]
    loop = StepLoop(sched, engine, overlap=True, depth=depth, steps=steps)
    streamed = drive(loop, sched, seqs, arrivals)
    for s, ref in zip(seqs, refs):
        want = ref[: ref.index(ref[stop_at[s.seq_id]]) + 1] if s.seq_id in stop_at else ref
        assert s.output_ids == want, f"prompt {s.seq_id}"
        assert streamed[s.seq_id] == want
    assert loop.steps > loop.overlapped + 10, "launches must run several steps"
    assert sched.blocks.num_free == 96
    if cap is not None:
        assert max(launched) == cap and launched.count(cap) > 5


@pytest.mark.parametrize("steps", [1, 3])
def test_lora_rows_through_the_graph_path(tmp_path, monkeypatch, steps):
    """Rows of two adapters and of the base model share each decode graph (the LoRA slots staged with the
    other inputs, kept across a launch's steps): every sequence gets peft's greedy tokens."""
    pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    from surge.engines.decoder import model as model_mod
    from tests.decoder_models import build_lora, load_peft

    torch.set_num_threads(1)
    d = build_model("qwen2", tmp_path / "q", seed=4)
    adapters = [build_lora(d, tmp_path / "a1", seed=1, r=4), build_lora(d, tmp_path / "a2", seed=2, r=2,
                                                                        targets=["v_proj", "up_proj"], scale=8)]
    refs_models = [AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()] + \
        [load_peft(d, a) for a in adapters]
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 300, (int(n),), generator=g).tolist() for n in (3, 17, 9, 30, 5, 12)]
    lens = [11, 19, 7, 14, 23, 9]
    slots = [0, 1, 2, 1, 2, 0]
    refs = [refs_models[k].generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                                    pad_token_id=0)[0, len(p):].tolist() for p, n, k in zip(prompts, lens, slots)]
    engine = DecoderEngine(d, num_blocks=96, block_size=4, max_num_seqs=6, max_loras=2, max_lora_rank=4)
    for k, a in enumerate(adapters, 1):
        engine.load_adapter(k, a)
    monkeypatch.setattr(model_mod, "paged_attention_torch", _host_graphs(engine, 6, steps=steps))
    sched = Scheduler(SchedulerConfig(num_blocks=96, block_size=4, max_num_seqs=6, max_num_batched_tokens=64,
                                      max_model_len=128), ())
    seqs = [Sequence(i, p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
            for i, (p, n) in enumerate(zip(prompts, lens))]
    for s, k in zip(seqs, slots):
        s.adapter, s.adapter_uid = k, k
    loop = StepLoop(sched, engine, overlap=True, depth=2, steps=steps)
    drive(loop, sched, seqs, [0, 0, 2, 2, 7, 13])
    for s, ref in zip(seqs, refs):
        assert s.output_ids == ref, f"prompt {s.seq_id} (slot {s.adapter})"
    assert loop.overlapped > 5, "the decode steps must take the graph path"


def _host_row_graphs(engine, rows, limit=None):
    """engine.row_graphs as the harness's eager replays (buckets up to `rows`), used for steps of up to `limit`
    tokens (default `rows`; more rows than the graphs hold: several replays)."""
    from surge.engines.decoder.graphs import DecodeGraphs

    g = DecodeGraphs(engine, rows, rows_share_kv=True)
    g.graphs = {b: _Replay(g, b) for b in g.buckets}
    g.outputs = {}
    engine.row_graphs, engine.graph_prefill_tokens = g, limit or rows
    return g


@pytest.mark.parametrize("kind", ["qwen2", "gpt2", "llama"])
def test_short_steps_prefill_through_the_row_graphs(tmp_path, monkeypatch, kind):
    """graph_prefill_tokens: a step of at most that many tokens in all (prompt chunks and the decodes beside
    them) replays the row graphs, a token a row at its own position attending to its sequence's cache up to
    itself, in several replays where it has more rows than the graphs hold (a later replay's rows read the
    earlier ones' keys from the cache); longer steps and steps that score prompt log-probabilities run
    eagerly. With prompts joining
    running sequences, a prompt cut into chunks by the token budget, a shared prefix (prefix-cache hits: the
    chunk starts past position 0) and a sampled sequence beside greedy ones, every sequence gets
    transformers' greedy tokens (the sampled one the eager engine's, seeded) and the prompt log-probabilities
    equal the eager engine's."""
    from transformers import AutoModelForCausalLM

    from surge.engines.decoder import model as model_mod

    torch.set_num_threads(1)
    d = build_model(kind, tmp_path / kind, seed=7)
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(3, 300, (13,), generator=g).tolist()
    prompts = [torch.randint(3, 300, (int(n),), generator=g).tolist() for n in (3, 17, 9, 45, 5)]
    prompts += [shared + [5, 6], shared + [7, 8, 9]]
    lens = [9, 14, 6, 8, 12, 7, 10]
    arrivals = [0, 0, 3, 5, 6, 9, 14]
    refs = [hf.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                        pad_token_id=0)[0, len(p):].tolist() for p, n in zip(prompts, lens)]
    sampled = SamplingParams(max_tokens=10, temperature=0.8, seed=11, ignore_eos=True, prompt_logprobs=2)

    def run(engine):
        scored, step = {}, engine.step

        def keep_scores(sc):  # the prompt's log-probabilities leave with the sequence's first token
            out = step(sc)
            scored.update({sid: o.prompt for sid, o in out.items() if getattr(o, "prompt", None)})
            return out

        engine.step = keep_scores
        sched = Scheduler(SchedulerConfig(num_blocks=96, block_size=4, max_num_seqs=6, max_num_batched_tokens=32,
                                          max_model_len=128), ())
        seqs = [Sequence(i, p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
                for i, (p, n) in enumerate(zip(prompts, lens))]
        seqs.append(Sequence(len(seqs), prompts[1][:11], sampled))
        streamed = drive(StepLoop(sched, engine, overlap=True, depth=2), sched, seqs, arrivals + [16])
        assert sched.blocks.num_free == 96
        return seqs, streamed, scored[len(prompts)]

    eager, _, eager_scores = run(DecoderEngine(d, num_blocks=96, block_size=4, max_num_seqs=6))
    engine = DecoderEngine(d, num_blocks=96, block_size=4, max_num_seqs=6)
    monkeypatch.setattr(model_mod, "paged_attention_torch", _host_graphs(engine, 6))
    rows = _host_row_graphs(engine, 12, limit=24)
    replayed, per_step, eager_steps = [], [], []
    run_rows, prepare, prefill = rows.run, engine.prepare, engine._prefill_graph

    def counted(ids, *a, **k):
        replayed.append(len(ids))
        per_step[-1] += 1
        return run_rows(ids, *a, **k)

    monkeypatch.setattr(rows, "run", counted)
    monkeypatch.setattr(engine, "_prefill_graph", lambda sc: per_step.append(0) or prefill(sc))
    monkeypatch.setattr(engine, "prepare", lambda sc: eager_steps.append(sum(s.num_tokens for s in sc))
                        or prepare(sc))
    seqs, streamed, scores = run(engine)
    for s, ref in zip(seqs, refs):
        assert s.output_ids == ref == streamed[s.seq_id], f"prompt {s.seq_id}"
    assert seqs[-1].output_ids == eager[-1].output_ids and len(seqs[-1].output_ids) == 10
    assert len(scores) == 10 and [t for t, *_ in scores] == [t for t, *_ in eager_scores]
    torch.testing.assert_close([v for _, v, *_ in scores], [v for _, v, *_ in eager_scores])
    assert [rank for *_, rank in scores] == [rank for *_, rank in eager_scores]
    assert max(replayed) == 12 and sum(n > 1 for n in replayed) >= 4 and max(per_step) == 2, \
        f"prefill steps through the rows, some in two replays: {per_step}, {replayed}"
    assert min(eager_steps) >= 11 and any(n > 24 for n in eager_steps), \
        f"steps over 24 tokens, and the one scoring prompt log-probabilities, run eagerly: {eager_steps}"


def test_staged_block_tables_equal_a_full_refill(tmp_path):
    """Only the rows that changed are rewritten in a staging set; what the set then holds is what
    filling all rows afresh gives (scratch after each row and in padded rows), through growing rows,
    rows taken by other (shorter) sequences, runs of rows sharing one sequence's table and buckets that
    shrink and grow."""
    import random

    import numpy as np

    from surge.engines.decoder.graphs import DecodeGraphs

    torch.set_num_threads(1)
    engine = DecoderEngine(build_model("qwen2", tmp_path / "q", seed=2), num_blocks=96, block_size=4, max_num_seqs=8)
    g = DecodeGraphs(engine, 8)
    scratch, width = engine.kv.scratch_block, g.width
    rng = random.Random(0)
    live = [[rng.randrange(96) for _ in range(rng.randrange(1, width))] for _ in range(8)]
    for step in range(300):
        if rng.random() < 0.3:  # a row grows by a block
            row = rng.choice(live)
            if len(row) < width:
                row.append(rng.randrange(96))
        if rng.random() < 0.1:  # a sequence leaves, another (maybe shorter) arrives
            live[rng.randrange(len(live))] = [rng.randrange(96) for _ in range(rng.randrange(1, width))]
        b = rng.choice((1, 3, 5, 8, 8, 8))
        tables = live[:b]
        if rng.random() < 0.5:  # rows of one sequence in runs (a prompt's tokens, drafts): one list object a run
            tables = [row for row in live for _ in range(rng.randrange(1, 4))][:b]
        bucket = next(x for x in g.buckets if x >= b)
        k = step % len(g.np_tables)
        g._stage_tables(k, tables, bucket)
        want = np.full((bucket, width), scratch, dtype=np.int32)
        for i, row in enumerate(tables):
            want[i, :len(row)] = row
        assert (g.np_tables[k][:bucket] == want).all(), step


def test_the_graph_prefill_setting_reaches_the_engine(tmp_path):
    """`--generation graph_prefill_tokens=N` is the engine's row-graph limit; 0 or a CPU engine: no row graphs."""
    from surge.config import GenerationConfig
    from surge.runtime.generate_load import decoder_engine_kwargs

    assert GenerationConfig().graph_prefill_tokens == 512
    gen = GenerationConfig.from_sources(["graph_prefill_tokens=64,max_num_seqs=8"])
    assert decoder_engine_kwargs(gen, "cuda", "bf16")["graph_prefill_tokens"] == 64
    assert decoder_engine_kwargs(GenerationConfig(graph_prefill_tokens=0), "cuda", "bf16")["graph_prefill_tokens"] == 0
    for bad in (-1, 4096):  # past 2,048 tokens the rows' attention (each over its whole context) outgrows the gain
        with pytest.raises(ValueError):
            GenerationConfig(graph_prefill_tokens=bad)
    kw = decoder_engine_kwargs(gen, "cpu", "fp32")
    engine = DecoderEngine(build_model("qwen2", tmp_path / "q", seed=2), num_blocks=32,
                           **{k: v for k, v in kw.items() if k not in ("kv_cache_tokens", "max_model_len")})
    assert engine.graph_prefill_tokens == 0 and engine.row_graphs is None  # CUDA graphs run on a GPU only


def test_row_graph_steps_are_bounded_by_their_tokens_and_keys(tmp_path):
    """A step takes the row graphs when its tokens are at most graph_prefill_tokens (T) and its prompt rows attend
    to at most T (T + 1) / 2 keys in all (a T-token prompt's from its start): a short chunk after a long cached
    context runs eagerly, decode rows count as tokens only; prompt log-probabilities to score: eager."""
    from surge.runtime.scheduler.step import ScheduledSeq

    engine = DecoderEngine(build_model("qwen2", tmp_path / "q", seed=2), num_blocks=64, block_size=4, max_num_seqs=6)
    _host_row_graphs(engine, 12, limit=24)  # keys: at most 24 * 25 / 2 = 300

    def chunk(start, n, seq_len=None, **params):
        seq = Sequence(0, list(range(3, 3 + (seq_len or start + n))), SamplingParams(max_tokens=4, **params))
        seq.block_table = list(range(-(-(seq_len or start + n) // 4)))
        return ScheduledSeq(seq, start, n, True)

    takes = engine._graph_rows
    assert takes([chunk(0, 24)])  # 300 keys, 24 tokens: two replays of the 12-row graphs
    assert not takes([chunk(0, 25)])  # 25 tokens
    assert takes([chunk(0, 10), chunk(0, 12)])  # 55 + 78 keys
    assert takes([chunk(20, 8)])  # 8 x 20 + 36 = 196 keys after a cached prefix
    assert not takes([chunk(40, 8)])  # 356 keys: the same chunk after a longer context
    assert takes([chunk(90, 1) for _ in range(6)] + [chunk(0, 16)])  # decode rows: tokens, not keys
    assert not takes([chunk(0, 8, prompt_logprobs=1)])
