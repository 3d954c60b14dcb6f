"""Speculative decoding by n-gram lookup: drafts from the sequence itself, checked in one step.

The answer must be plain greedy decoding's, token for token (transformers' `generate` as the
reference), whatever the drafts: sequences join and leave, share a prefix, are preempted, stop on
a stop token inside a run of accepted drafts, end at max_tokens; the step loop with launched
steps in flight; the CUDA-graph path's host logic (draft rows in padded buckets) on the CPU.
"""

from __future__ import annotations

import random

import pytest

from surge.runtime.scheduler import SamplingParams, Scheduler, SchedulerConfig, Sequence
from surge.runtime.scheduler.ngram import NgramIndex, NgramProposer
from surge.runtime.scheduler.step import ScheduledSeq


def scan_propose(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """The definition, by a scan: the longest suffix (n_max down to n_min) that occurred earlier, its
    latest earlier occurrence, what followed it, running on periodically past the end."""
    end = len(tokens)
    for n in range(min(n_max, end - 1), n_min - 1, -1):
        suffix = tokens[end - n:]
        for e in range(end - 1, n - 1, -1):  # an occurrence ending at e < end, latest first
            if tokens[e - n:e] == suffix:
                ext = list(tokens)
                while len(ext) < e + k:
                    ext.append(ext[len(ext) - (end - e)])
                return ext[e:e + k]
    return []


@pytest.mark.parametrize("seed", range(6))
def test_ngram_index_equals_a_scan(seed):
    """The incremental index proposes what a scan of the whole sequence finds, as the sequence grows
    by 1 to 4 tokens a step (a small vocabulary: matches of every length, overlapping runs)."""
    rng = random.Random(seed)
    n_min, n_max = rng.choice([(1, 3), (2, 4), (2, 2), (3, 5)])
    tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 12))]
    index = NgramIndex(n_min, n_max)
    found = 0
    for _ in range(60):
        k = rng.randrange(0, 6)
        got = index.propose(tokens, k)
        assert got == scan_propose(tokens, k, n_min, n_max), (tokens, k)
        found += bool(got)
        tokens += [rng.randrange(4) if rng.random() < 0.6 else tokens[-1] for _ in range(rng.randrange(1, 5))]
    assert found > 10


def test_a_repeating_pattern_runs_on_into_the_draft():
    index = NgramIndex(2, 4)
    assert index.propose([7, 1, 2, 3, 1, 2, 3, 1, 2], 5) == [3, 1, 2, 3, 1]
    assert NgramIndex(2, 4).propose([5, 5, 5], 4) == [5, 5, 5, 5]
    assert NgramIndex(2, 4).propose([1, 2, 3, 4], 3) == []  # nothing repeats
    proposer = NgramProposer(3, 2, 4)
    assert proposer.propose(1, [9, 8, 9, 8, 9], limit=2) == [8, 9]  # limit (max_tokens) under k
    assert proposer.propose(1, [9, 8, 9, 8, 9, 8], limit=0) == []
    with pytest.raises(ValueError):
        NgramProposer(0)
    with pytest.raises(ValueError):
        NgramProposer(3, 3, 2)


def _decoding(sched: Scheduler, prompt: list[int], seq_id: int, **params) -> ScheduledSeq:
    """A sequence admitted and prefilled (its first token sampled): scheduled for a decode step."""
    seq = Sequence(seq_id, prompt, SamplingParams(temperature=0.0, **params))
    sched.add(seq)
    (s,) = [x for x in sched.schedule() if x.seq is seq]
    sched.update([s], {seq_id: 50})
    (s,) = [x for x in sched.schedule() if x.seq is seq]
    return s


def test_accept_keeps_the_agreeing_drafts_and_the_models_next_token():
    sched = Scheduler(SchedulerConfig(num_blocks=32, block_size=4, max_num_seqs=4, max_num_batched_tokens=64,
                                      max_model_len=64), eos_token_ids=(99,))
    a = _decoding(sched, [1, 2, 3], 0, max_tokens=20)
    b = _decoding(sched, [4, 5], 1, max_tokens=20, stop_token_ids=(61,))
    c = _decoding(sched, [6], 2, max_tokens=3)  # one token out, two more allowed
    d = _decoding(sched, [7, 7], 3, max_tokens=20)
    assert sched.draft_limit(c.seq, 5) == 1  # a step accepting d drafts adds d + 1 tokens
    scheduled = [a, b, c, d]
    drafts = [[60, 61, 62], [60, 61, 62], [70], [80, 81]]
    drafts = sched.make_room(scheduled, drafts)
    greedy = [[60, 61, 5, 9],  # two kept, then the model's 5
              [60, 61, 62, 63],  # all kept... but 61 is a stop token: ends there
              [70, 71],  # kept, then 71: max_tokens reached
              [1, 2, 3]]  # the first draft is wrong: the model's 1 only
    per_index = sched.accept(scheduled, drafts, greedy)
    assert [s.seq.output_ids for s in scheduled] == [[50, 60, 61, 5], [50, 60, 61], [50, 70, 71], [50, 1]]
    assert [sorted(t.items()) for t, _ in per_index] == [
        [(0, 60), (1, 60), (2, 70), (3, 1)], [(0, 61), (1, 61), (2, 71)], [(0, 5)]]
    assert {f.seq.seq_id: f.reason for _, fin in per_index for f in fin} == {1: "stop", 2: "length"}
    # the K/V of every accepted input is computed; the newest token is the next step's input
    assert a.seq.num_computed == a.seq.num_tokens - 1 == 6
    assert d.seq.num_computed == d.seq.num_tokens - 1
    sched.blocks.check()


def test_drafts_never_take_blocks_another_sequence_needs():
    """With no free block, drafts are cut to the sequence's own blocks; nothing is preempted."""
    sched = Scheduler(SchedulerConfig(num_blocks=2, block_size=4, max_num_seqs=2, max_num_batched_tokens=64,
                                      max_model_len=64))
    s = _decoding(sched, [1, 2], 0, max_tokens=20)  # 3 tokens (input at position 2): one block, position 3 free
    other = _decoding(sched, [3], 1, max_tokens=20)  # takes the last block
    assert sched.blocks.num_free == 0
    # s keeps the draft its block holds (position 3), not those a new block would
    assert sched.make_room([s, other], [[5, 6, 7], [8]]) == [[5], [8]]
    assert sched.preemptions == 0 and other.seq.status.value == "running"


torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from surge.engines.decoder import DecoderEngine  # noqa: E402
from surge.runtime.scheduler.overlap import StepLoop  # noqa: E402
from tests.decoder_models import build_model  # noqa: E402
from tests.loop_driver import drive  # noqa: E402

KINDS = ("gpt2", "qwen2", "llama")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("spec")
    dirs = {k: build_model(k, root / k, seed=10 + i) for i, k in enumerate(KINDS)}
    hf = {k: AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval() for k, d in dirs.items()}
    yield dirs, hf
    torch.set_num_threads(before)


def hf_greedy(model, prompt, n):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def repetitive_prompts(vocab: int, seed: int) -> list[list[int]]:
    """Prompts that repeat their own pieces (the lookup finds matches in the prompt too), one without
    repeats, and three with a shared 13-token prefix (prefix-cache hits)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in (5, 17, 9, 30, 2, 12):
        base = torch.randint(3, vocab, (n,), generator=g).tolist()
        out.append(base + base[: n // 2] + base)
    shared = torch.randint(3, vocab, (13,), generator=g).tolist()
    out += [shared + [5, 6], shared + [7], shared + [8, 9, 10]]
    return out


def drive_arrivals(loop, sched, seqs, arrivals, before_step=None) -> dict[int, list[int]]:
    """tests/loop_driver.drive with seqs[i] arriving at step arrivals[i] in any order."""
    order = sorted(range(len(seqs)), key=lambda i: arrivals[i])
    return drive(loop, sched, [seqs[i] for i in order], [arrivals[i] for i in order], before_step)


def run_loop(engine, prompts, params, arrivals, *, overlap=False, depth=2, k=3, num_blocks=40, max_num_seqs=4):
    sched = Scheduler(SchedulerConfig(num_blocks=num_blocks, block_size=4, max_num_seqs=max_num_seqs,
                                      max_num_batched_tokens=24, max_model_len=256), engine.cfg.eos_token_ids)
    seqs = [Sequence(i, p, prm) for i, (p, prm) in enumerate(zip(prompts, params))]
    loop = StepLoop(sched, engine, overlap=overlap, depth=depth, speculator=NgramProposer(k, 1, 3) if k else None)
    streamed = drive_arrivals(loop, sched, seqs, arrivals)
    assert sched.blocks.num_free == num_blocks
    return seqs, streamed, loop, sched


@pytest.mark.parametrize("kind,overlap", [("gpt2", False), ("qwen2", False), ("llama", False), ("qwen2", True)])
def test_speculative_greedy_equals_transformers(kind, overlap, models):
    """Joins (later arrivals, more prompts than max_num_seqs), a shared prefix, a KV cache small enough
    to preempt, stop tokens inside runs of accepted drafts, different max_tokens; with `overlap`, the
    loop launches steps ahead where no sequence has drafts and reads them back before it looks drafts up."""
    dirs, hf = models
    engine = DecoderEngine(dirs[kind], num_blocks=32, block_size=4)
    prompts = repetitive_prompts(engine.cfg.vocab_size, 7)
    n_new = [24, 30, 11, 26, 19, 28, 22, 17, 25]
    refs = [hf_greedy(hf[kind], p, n) for p, n in zip(prompts, n_new)]
    # every third sequence stops at its 9th token (inside a run of repeats: drafts accepted past it)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True,
                             stop_token_ids=(refs[i][8],) if i % 3 == 0 else ())
              for i, n in enumerate(n_new)]
    arrivals = [0, 0, 0, 2, 5, 9, 0, 30, 31]
    launches = []
    launch = engine.launch
    engine.launch = lambda *a, **kw: launches.append(1) or launch(*a, **kw)
    seqs, streamed, loop, sched = run_loop(engine, prompts, params, arrivals, overlap=overlap, num_blocks=32)
    for s, ref in zip(seqs, refs):
        want = ref[: ref.index(ref[8]) + 1] if s.seq_id % 3 == 0 else ref
        assert s.output_ids == want, f"prompt {s.seq_id}"
        assert streamed[s.seq_id] == want  # each token handed out once, in order
        assert s.finish_reason == ("stop" if s.seq_id % 3 == 0 else "length")
    assert loop.spec_steps > 5 and 0 < loop.accepted < loop.drafted, (loop.accepted, loop.drafted)
    assert sched.preemptions > 0 and sched.blocks.hit_tokens > 0
    assert bool(launches) == overlap  # steps without drafts launched (and read back before the next lookup)


def test_speculation_computes_fewer_steps_on_repeats(models):
    """The point of it: on text the model repeats, one step yields several tokens."""
    dirs, hf = models
    engine = DecoderEngine(dirs["qwen2"], num_blocks=40, block_size=4)
    prompts = repetitive_prompts(engine.cfg.vocab_size, 3)[:4]
    params = [SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True) for _ in prompts]
    plain = run_loop(engine, prompts, params, [0] * 4, k=0)
    spec = run_loop(DecoderEngine(dirs["qwen2"], num_blocks=40, block_size=4), prompts, params, [0] * 4, k=4)
    assert [s.output_ids for s in spec[0]] == [s.output_ids for s in plain[0]]
    tokens_per_step = 4 * 30 / spec[2].steps
    assert spec[2].steps < plain[2].steps and spec[2].accepted > 0, (spec[2].steps, plain[2].steps, tokens_per_step)


def test_speculation_only_in_small_batches_when_capped(models):
    """max_batch (speculative_max_batch): steps of more sequences decode as before, launched ahead; drafts
    are checked once few enough sequences run; the tokens are transformers' throughout."""
    dirs, hf = models
    engine = DecoderEngine(dirs["gpt2"], num_blocks=64, block_size=4)
    sizes = []
    verify = engine.verify
    engine.verify = lambda scheduled, drafts: sizes.append(len(scheduled)) or verify(scheduled, drafts)
    prompts = repetitive_prompts(engine.cfg.vocab_size, 4)[:4]
    n_new = [8, 12, 30, 34]  # two leave early: the last two run on alone
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in n_new]
    sched = Scheduler(SchedulerConfig(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=256,
                                      max_model_len=256), engine.cfg.eos_token_ids)
    seqs = [Sequence(i, p, prm) for i, (p, prm) in enumerate(zip(prompts, params))]
    for s in seqs:
        sched.add(s)
    loop = StepLoop(sched, engine, overlap=True, speculator=NgramProposer(3, 1, 3, max_batch=2))
    while loop.busy:
        loop.step()
    for s, p, n in zip(seqs, prompts, n_new):
        assert s.output_ids == hf_greedy(hf["gpt2"], p, n), f"prompt {s.seq_id}"
    assert sizes and max(sizes) <= 2 and loop.accepted > 0
    assert loop.overlapped > 0  # while 4 ran, steps were launched ahead as without speculation


def test_logprob_and_penalized_requests_are_not_speculated(models):
    """Rows that score logprobs or change the logits (penalties) sample on the host a token a step, as
    without speculation, beside greedy rows that are speculated."""
    dirs, _ = models
    prompts = repetitive_prompts(384, 5)[:3]
    params = [SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=16, temperature=0.8, seed=11, repetition_penalty=1.3, ignore_eos=True),
              SamplingParams(max_tokens=16, temperature=0.0, logprobs=2, ignore_eos=True)]
    outs = []
    for k in (0, 3):
        engine = DecoderEngine(dirs["llama"], num_blocks=40, block_size=4)
        seqs, _, loop, _ = run_loop(engine, prompts, params, [0, 0, 0], k=k, max_num_seqs=1)
        outs.append([s.output_ids for s in seqs])
    assert outs[0] == outs[1]
    assert loop.accepted > 0  # the greedy one, alone in its steps, was speculated


def _draws(probs_logits: torch.Tensor, drafts: list[int], n: int, **params) -> list[list[int]]:
    """n speculative draws (Sampler.speculative) of one sequence's rows, in one call."""
    from surge.engines.decoder.sampler import Sampler

    sampler = Sampler(torch.device("cpu"))
    sampler._shared.manual_seed(1234)
    seq = Sequence(0, [1], SamplingParams(ignore_eos=True, **params))
    rows = probs_logits.shape[0]
    logits = probs_logits.repeat(n, 1)
    return sampler.speculative(logits, [(i * rows, seq, drafts) for i in range(n)])


@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(temperature=0.7, top_k=4),
                                    dict(temperature=1.3, top_p=0.8)])
def test_speculative_draws_are_distributed_as_plain_sampling(params):
    """Against the exact distributions (float64, the sampler's own filters applied): the first new token
    is distributed as p_0 whatever the draft; after a kept draft the next is distributed as p_1; after two
    kept, the drawn token as p_2. 30,000 draws, total variation within 0.02 (drafts kept whatever their
    row drew miss by ~0.7)."""
    from surge.engines.decoder.sampler import Sampler

    g = torch.Generator().manual_seed(7)
    logits = torch.randn(3, 8, generator=g) * 1.5
    drafts = [int(logits[0].argsort()[-2]), int(logits[1].argmax())]  # a likely token, the likeliest
    sp = SamplingParams(ignore_eos=True, **params)
    exact = Sampler._probs(logits.double(), [sp] * 3)
    draws = _draws(logits, drafts, 30_000, **params)

    def tv(samples, p):
        counts = torch.bincount(torch.tensor(samples), minlength=p.shape[0]).double()
        return 0.5 * (counts / counts.sum() - p).abs().sum().item(), len(samples)

    first = [d[0] for d in draws]
    second = [d[1] for d in draws if d[0] == drafts[0]]
    third = [d[2] for d in draws if d[:2] == drafts]
    for samples, p in ((first, exact[0]), (second, exact[1]), (third, exact[2])):
        dist, n = tv(samples, p)
        assert n > 1500 and dist < 0.02, (params, dist, n)
    assert all(len(d) <= 3 for d in draws) and {len(d) for d in draws} == {1, 2, 3}
    # a refused draft is never the token drawn in its place
    assert all(d[-1] != drafts[len(d) - 1] for d in draws if len(d) <= 2)


def test_seeded_sampling_with_speculation_is_plain_samplings_whatever_the_batch(models):
    """A seeded sampled sequence is speculated (each draft row draws as plain sampling would there) and
    gives plain sampling's tokens (no speculation), alone and beside other sequences."""
    dirs, _ = models
    prompts = repetitive_prompts(384, 6)[:4]
    seeded = SamplingParams(max_tokens=24, temperature=0.3, top_p=0.95, seed=5, ignore_eos=True)
    others = [SamplingParams(max_tokens=n, temperature=t, ignore_eos=True) for n, t in ((9, 0.0), (30, 1.0), (14, 0.0))]
    runs = []
    for batch, k in (([prompts[0]], 0), ([prompts[0]], 3), (prompts, 3), (prompts, 0)):
        engine = DecoderEngine(dirs["qwen2"], num_blocks=64, block_size=4)
        seqs, streamed, loop, _ = run_loop(engine, batch, [seeded, *others][:len(batch)], [0, 0, 1, 2][:len(batch)],
                                           num_blocks=64, k=k)
        runs.append(seqs[0].output_ids)
        assert streamed[0] == seqs[0].output_ids and len(seqs[0].output_ids) == 24
        assert (loop.accepted > 0) == bool(k)
    assert runs[0] == runs[1] == runs[2] == runs[3]


def test_graph_path_with_draft_rows(models, monkeypatch):
    """The CUDA-graph path's host logic on the CPU (tests/unit/test_decoder_graph_buffers.py's harness):
    a sequence's input and drafts staged as rows of one bucket, padded rows, block tables repeated per
    row, each row's context ending at itself; the tokens are transformers'."""
    from surge.engines.decoder import model as model_mod
    from tests.unit.test_decoder_graph_buffers import _host_graphs

    dirs, hf = models
    engine = DecoderEngine(dirs["qwen2"], num_blocks=48, block_size=4, max_num_seqs=4, speculative_tokens=3)
    attention = _host_graphs(engine, 4)  # the decode graphs (launches without drafts)
    from surge.engines.decoder.graphs import DecodeGraphs
    from tests.unit.test_decoder_graph_buffers import _Replay

    spec = DecodeGraphs(engine, 4 * 4, rows_share_kv=True)
    spec.graphs = {b: _Replay(spec, b) for b in spec.buckets}
    spec.outputs = {}
    engine.row_graphs = spec
    seen = []

    def recording(q, k_cache, v_cache, meta, scale):
        seen.append(meta.rows_share_kv)
        return attention(q, k_cache, v_cache, meta, scale)

    monkeypatch.setattr(model_mod, "paged_attention_torch", recording)
    prompts = repetitive_prompts(engine.cfg.vocab_size, 9)[:6]
    n_new = [20, 14, 25, 9, 18, 22]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in n_new]
    seqs, _, loop, _ = run_loop(engine, prompts, params, [0, 0, 1, 3, 4, 8], overlap=True, num_blocks=48)
    for s, p, n in zip(seqs, prompts, n_new):
        assert s.output_ids == hf_greedy(hf["qwen2"], p, n), f"prompt {s.seq_id}"
    assert loop.spec_steps > 3 and loop.accepted > 0
    assert any(seen), "the draft rows' attention was told that rows share a sequence's cache"


def test_the_setting_is_checked():
    from surge.config import GenerationConfig

    assert GenerationConfig(speculative_tokens=4).speculative_tokens == 4
    assert GenerationConfig.from_sources(["speculative_tokens=3,speculative_max_batch=8"]).speculative_max_batch == 8
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        GenerationConfig(speculative_tokens=4, prompt_lookup_min=5, prompt_lookup_max=3)
    with pytest.raises(ValueError):
        GenerationConfig(speculative_tokens=-1)


def test_lora_rows_keep_their_adapter_in_draft_rows(tmp_path):
    """A sequence's drafts are rows of its LoRA slot: base-model and adapter sequences speculated in one
    step give peft's greedy answers."""
    from transformers import AutoModelForCausalLM

    from tests.decoder_models import build_lora, load_peft

    base = build_model("qwen2", tmp_path / "base", seed=31)
    adapter = build_lora(base, tmp_path / "lora", seed=32, r=8, alpha=16)
    engine = DecoderEngine(base, num_blocks=64, block_size=4, max_loras=1, max_lora_rank=8)
    engine.load_adapter(1, adapter)
    refs = {0: AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval(), 1: load_peft(base, adapter)}
    prompts = repetitive_prompts(engine.cfg.vocab_size, 8)[:3]
    sched = Scheduler(SchedulerConfig(num_blocks=64, block_size=4, max_num_seqs=6, max_num_batched_tokens=256,
                                      max_model_len=256), engine.cfg.eos_token_ids)
    seqs, want = [], []
    for slot in (0, 1):
        for p in prompts:
            seq = Sequence(len(seqs), p, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
            seq.adapter, seq.adapter_uid = slot, 7 * slot
            seqs.append(seq)
            want.append(hf_greedy(refs[slot], p, 20))
            sched.add(seq)
    loop = StepLoop(sched, engine, overlap=False, speculator=NgramProposer(3, 1, 3))
    while loop.busy:
        loop.step()
    assert [s.output_ids for s in seqs] == want
    assert want[:3] != want[3:], "the adapter must change the answers"
    assert loop.accepted > 0


def test_the_service_cuts_stop_strings_and_frees_an_abandoned_stream(tmp_path):
    """Through GenerateService (the routes' API) with speculation on: several tokens reach a stream per step,
    yet a stop string cuts the text where it starts, as without speculation; a stream closed after two
    deltas frees its KV blocks; the metrics count every token."""
    import asyncio

    from prometheus_client import CollectorRegistry

    from tests.unit.test_generate_stream import _service, _value

    path = build_model("qwen2", tmp_path / "m", seed=3)
    plain, reg = _service(path, CollectorRegistry()), CollectorRegistry()
    spec = _service(path, reg, speculative_tokens=3, speculative_max_batch=8, cache_entries=0)
    prompt = spec.encode("The augmented assignment, the augmented assignment, the augmented")

    async def main():
        full = await plain.generate(prompt, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
                                    use_cache=False)
        stop = full.text[len(full.text) // 2:len(full.text) // 2 + 4]
        cut = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=(stop,))
        want = await plain.generate(prompt, cut, use_cache=False)
        got = await spec.generate(prompt, cut, use_cache=False)
        whole = await spec.generate(prompt, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
                                    use_cache=False)
        agen = spec.stream(prompt, SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True))
        seen = [await agen.__anext__(), await agen.__anext__()]
        await agen.aclose()
        for _ in range(100):
            await asyncio.sleep(0.02)
            if spec.stats()["running"] == 0:
                break
        stats = spec.stats()
        await plain.close()
        await spec.close()
        return full, stop, want, got, whole, seen, stats

    full, stop, want, got, whole, seen, stats = asyncio.run(main())
    assert whole.text == full.text and whole.token_ids == full.token_ids
    assert got.text == want.text == full.text[:full.text.index(stop)] and got.finish_reason == "stop"
    assert all(d.token_ids for d in seen)
    assert stats["running"] == 0 and stats["accepted_tokens"] > 0
    assert stats["free_blocks"] == spec.engine.num_blocks
    assert _value(reg, "surge_generate_requests_total", finish_reason="abort") == 1
    assert _value(reg, "surge_generate_spec_accepted_tokens_total") == stats["accepted_tokens"]


@pytest.mark.parametrize("draft_kind", ["same", "llama"])
def test_a_draft_model_proposes_and_the_answer_stays_the_targets(tmp_path, models, draft_kind):
    """Draft-model speculation: the draft (the target's own weights: its guesses all right; or a smaller
    Llama of the same tokenizer: mostly wrong) decodes k tokens a step in blocks numbered as the target's,
    catching up on what it has not computed (the prompt, plain steps, refused drafts, a preemption);
    the answers are transformers' greedy ones, with joins, a shared prefix and a KV cache small enough
    to preempt."""
    import shutil

    dirs, hf = models
    target = dirs["qwen2"]
    if draft_kind == "same":
        draft = tmp_path / "draft"
        shutil.copytree(target, draft)
    else:
        draft = build_model("llama", tmp_path / "draft", seed=40, hidden_size=32, intermediate_size=64,
                            num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=1)
    engine = DecoderEngine(target, num_blocks=32, block_size=4, speculative_tokens=3, speculative_model=draft)
    assert engine.draft is not None and engine.draft.num_blocks == engine.num_blocks
    from surge.runtime.scheduler.draft_model import DraftModelProposer

    prompts = repetitive_prompts(engine.cfg.vocab_size, 7)
    n_new = [24, 30, 11, 26, 19, 28, 22, 17, 25]
    refs = [hf_greedy(hf["qwen2"], p, n) for p, n in zip(prompts, n_new)]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in n_new]
    sched = Scheduler(SchedulerConfig(num_blocks=32, block_size=4, max_num_seqs=4, max_num_batched_tokens=24,
                                      max_model_len=256), engine.cfg.eos_token_ids)
    seqs = [Sequence(i, p, prm) for i, (p, prm) in enumerate(zip(prompts, params))]
    proposer = DraftModelProposer(engine.draft, 3)
    loop = StepLoop(sched, engine, overlap=True, speculator=proposer)
    # the draft's first layer K of a position depends on its token and position alone: what the proposer
    # counts as computed must hold the sequence's own tokens there (not a refused draft's, not a freed block's)
    ref = DecoderEngine(draft, num_blocks=32, block_size=4)
    checked = 0

    def check_draft_cache():
        nonlocal checked
        for seq in sched.running:
            done, preempted = proposer._done.get(seq.seq_id, (0, seq.preemptions))
            if preempted != seq.preemptions or done == 0:
                continue
            ref.step([ScheduledSeq(seq, 0, done, False)])
            slots = [seq.block_table[p // 4] * 4 + p % 4 for p in range(done)]
            got, want = (e.kv.k[0].reshape(-1, *e.kv.k[0].shape[2:])[slots] for e in (engine.draft, ref))
            assert torch.allclose(got, want, atol=1e-5), (seq.seq_id, done)
            checked += 1

    drive_arrivals(loop, sched, seqs, [0, 0, 0, 2, 5, 9, 0, 30, 31], before_step=lambda step: check_draft_cache())
    assert checked > 20
    for s, ref in zip(seqs, refs):
        assert s.output_ids == ref, f"prompt {s.seq_id}"
    assert loop.spec_steps > 5 and sched.preemptions > 0
    if draft_kind == "same":
        assert loop.accepted > 0.9 * loop.drafted, (loop.accepted, loop.drafted)
    else:
        assert loop.drafted > 0 and loop.accepted < 0.9 * loop.drafted


def test_a_draft_model_that_cannot_stand_in_is_refused(tmp_path, models):
    from surge.config import GenerationConfig
    from surge.errors import ConfigError

    dirs, _ = models
    with pytest.raises(ConfigError, match="speculative_tokens"):
        DecoderEngine(dirs["qwen2"], num_blocks=8, block_size=4, speculative_model=dirs["llama"])
    wide = build_model("qwen2", tmp_path / "wide", seed=1, vocab=512)  # another tokenizer, a larger vocabulary
    with pytest.raises(ConfigError, match="vocabulary|tokenizer"):
        DecoderEngine(dirs["qwen2"], num_blocks=8, block_size=4, speculative_tokens=2, speculative_model=wide)
    with pytest.raises(ValueError, match="speculative_tokens"):
        GenerationConfig(speculative_model=str(dirs["llama"]))


def test_a_repositorys_draft_model_is_found_beside_its_model_yaml(tmp_path, models):
    """model.yaml's generation.speculative_model is a path relative to its version directory (as `source`):
    the decoder is loaded with it resolved there; a draft directory that does not exist is the version's
    error, naming the field; the server's own setting is left as given."""
    import shutil

    from surge.cli.bootstrap import decoder_settings
    from surge.config import GenerationConfig, ServerConfig
    from surge.runtime.repository import scan_model

    dirs, _ = models
    version = tmp_path / "repo" / "chat" / "1"
    shutil.copytree(dirs["llama"], version / "draft")
    (version / "model.yaml").write_text(f"source: {dirs['qwen2']}\n"
                                        "generation: {speculative_tokens: 2, speculative_model: draft}\n")
    entry = scan_model(tmp_path / "repo", "chat").versions["1"]
    assert entry.error is None
    _, _, gen = decoder_settings(ServerConfig(), entry)
    assert gen.speculative_model == str((version / "draft").resolve()) and gen.speculative_tokens == 2
    server = ServerConfig(generation=GenerationConfig(speculative_tokens=3, speculative_model="/elsewhere/draft"))
    (version / "model.yaml").write_text(f"source: {dirs['qwen2']}\n")
    _, _, gen = decoder_settings(server, scan_model(tmp_path / "repo", "chat").versions["1"])
    assert gen.speculative_model == "/elsewhere/draft"
    (version / "model.yaml").write_text(f"source: {dirs['qwen2']}\n"
                                        "generation: {speculative_tokens: 2, speculative_model: nodraft}\n")
    error = scan_model(tmp_path / "repo", "chat").versions["1"].error
    assert "generation.speculative_model" in error and "nodraft" in error, error
