"""The decoder engine on a CUDA GPU: the Triton paged-attention kernel, BF16 against transformers,
CUDA-graph decode against eager decode."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.cuda


def _meta(qlens, ctxs, page, nb, dev):
    from surge.engines.decoder.attention import AttnMeta

    perm = torch.randperm(nb).tolist()
    tables, off = [], 0
    for c in ctxs:
        k = -(-c // page)
        tables.append(perm[off:off + k])
        off += k
    width = max(len(t) for t in tables)
    tab = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=dev)
    qs = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    return AttnMeta(None, tab, torch.tensor(ctxs, dtype=torch.int32, device=dev), qs, max(qlens), qlens, ctxs, tables)


@pytest.mark.parametrize("hq,hkv,d,page", [(14, 2, 64, 16), (32, 8, 64, 16), (12, 12, 64, 16), (8, 2, 128, 16)])
def test_paged_attention_kernel_matches_torch(hq, hkv, d, page):
    from surge.engines.decoder.attention import paged_attention_torch
    from surge.engines.kernels.paged_attention import paged_attention

    torch.manual_seed(0)
    dev = "cuda"
    nb = 400
    kc = torch.randn(nb, page, hkv, d, device=dev, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    for qlens, ctxs in [([1] * 9, [1, 5, 16, 17, 64, 100, 257, 300, 31]), ([7, 1, 128, 3], [7, 300, 200, 64]),
                        ([128], [128]), ([1], [1000])]:
        meta = _meta(qlens, ctxs, page, nb, dev)
        q = torch.randn(sum(qlens), hq, d, device=dev, dtype=torch.bfloat16)
        ref = paged_attention_torch(q.float(), kc.float(), vc.float(), meta, d ** -0.5)
        for block_n in (None, 128, 256):  # keys per iteration of a decode step (engine: 128)
            out = paged_attention(q, kc, vc, meta, d ** -0.5, block_n=block_n)
            err = (out.float() - ref).abs().max().item()
            assert err < 2e-2, (qlens, ctxs, block_n, err)


def test_argmax_rows_equals_torch_argmax():
    """The decode graph's greedy argmax (two passes over the BF16 logits): torch's index, ties
    (the first maximum) included."""
    from surge.engines.kernels.decoder_fused import argmax_rows

    torch.manual_seed(0)
    for b, v in [(64, 151936), (1, 1000), (5, 4096), (3, 4097), (17, 50257)]:
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.randn(b, v, device="cuda").to(dtype)
            assert torch.equal(argmax_rows(x), x.argmax(-1)), (b, v, dtype)
            ties = torch.randint(-3, 4, (b, v), device="cuda").to(dtype)  # the maximum many times a row
            assert torch.equal(argmax_rows(ties), ties.argmax(-1)), (b, v, dtype)


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    from tests.decoder_models import build_model

    return build_model("qwen2", tmp_path_factory.mktemp("qwen2_gpu"), seed=3, hidden_size=256, intermediate_size=512,
                       num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512)


def _with_adapters(seqs, adapters):
    """Give sequence i LoRA slot adapters[i] (its uid the slot: one adapter a slot in these tests)."""
    for s, slot in zip(seqs, adapters or ()):
        s.adapter, s.adapter_uid = slot, slot
    return seqs


def _run(engine, prompts, n, max_num_seqs=16, logprobs=None, tops=None, adapters=None):
    from surge.runtime.scheduler import SamplingParams, Scheduler, SchedulerConfig, Sequence

    sched = Scheduler(SchedulerConfig(num_blocks=engine.num_blocks, block_size=engine.block_size,
                                      max_num_seqs=max_num_seqs, max_num_batched_tokens=512, max_model_len=512), ())
    seqs = _with_adapters([Sequence(i, p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True,
                                                         logprobs=logprobs)) for i, p in enumerate(prompts)], adapters)
    for s in seqs:
        sched.add(s)
    while sched.has_work:
        scheduled = sched.schedule()
        outs = engine.step(scheduled)
        if tops is not None:
            for k, v in outs.items():
                tops.setdefault(k, []).append(list(v.top or []))
        sched.update(scheduled, {k: v.token for k, v in outs.items()})
    return [s.output_ids for s in seqs]


def _prompts(vocab, n=12):
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, vocab, (int(l),), generator=g).tolist() for l in torch.randint(4, 120, (n,), generator=g)]


def _run_overlapped(engine, prompts, n, max_num_seqs=16, steps=1, loops=None, adapters=None):
    """The service's loop (overlapped CUDA-graph decode steps, `steps` a launch); returns outputs and
    overlapped steps (the loop appended to `loops`)."""
    from surge.runtime.scheduler import SamplingParams, Scheduler, SchedulerConfig, Sequence
    from surge.runtime.scheduler.overlap import StepLoop

    sched = Scheduler(SchedulerConfig(num_blocks=engine.num_blocks, block_size=engine.block_size,
                                      max_num_seqs=max_num_seqs, max_num_batched_tokens=512, max_model_len=512), ())
    seqs = _with_adapters([Sequence(i, p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
                           for i, p in enumerate(prompts)], adapters)
    for s in seqs:
        sched.add(s)
    loop = StepLoop(sched, engine, steps=steps)
    while loop.busy:
        loop.step()
    if loops is not None:
        loops.append(loop)
    return [s.output_ids for s in seqs], loop.overlapped


def _run_speculating(engine, prompts, n, speculator, **params):
    """The service's loop (4-step launches where no sequence has drafts) with `speculator` (speculative
    decoding) over `n` tokens of each prompt, greedy unless `params` say otherwise (a seed each: 100 + i);
    returns the outputs and the loop."""
    from surge.runtime.scheduler import SamplingParams, Scheduler, SchedulerConfig, Sequence
    from surge.runtime.scheduler.overlap import StepLoop

    sched = Scheduler(SchedulerConfig(num_blocks=engine.num_blocks, block_size=engine.block_size, max_num_seqs=16,
                                      max_num_batched_tokens=512, max_model_len=512), ())
    params = params or {"temperature": 0.0}
    seqs = [Sequence(i, p, SamplingParams(max_tokens=n, ignore_eos=True, **params,
                                          **({"seed": 100 + i} if params.get("temperature") else {})))
            for i, p in enumerate(prompts)]
    for s in seqs:
        sched.add(s)
    loop = StepLoop(sched, engine, steps=4, speculator=speculator)
    while loop.busy:
        loop.step()
    return [s.output_ids for s in seqs], loop


@pytest.fixture(scope="module")
def trained_dir(tmp_path_factory):
    """A Qwen2-shaped model fitted for a few hundred steps to a corpus with structure (each token's
    successor is fixed with probability 0.85, else random): its greedy choices have the margins of
    a trained model, where random weights tie within BF16's rounding."""
    from tests.decoder_models import build_model

    d = build_model("qwen2", tmp_path_factory.mktemp("qwen2_trained"), seed=11, hidden_size=256,
                    intermediate_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                    max_position_embeddings=512)
    return _fit(d, lr=2e-3)


@pytest.fixture(scope="module")
def llama_1b_layers_dir(tmp_path_factory):
    """Two layers of Llama-3.2-1B's shape (hidden 2048, FFN 8192, 32 query / 8 KV heads: the GEMMs with
    measured TMA split-K and gate/up plans since session 20), fitted as trained_dir is."""
    from tests.decoder_models import build_model

    d = build_model("llama", tmp_path_factory.mktemp("llama_1b_layers"), seed=13, hidden_size=2048,
                    intermediate_size=8192, num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=8,
                    max_position_embeddings=512, initializer_range=0.02)
    return _fit(d, lr=1e-3)


def _fit(d, lr):
    """Fit the model at d for 300 steps to a corpus whose tokens mostly follow a fixed successor map, and
    save it over d."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).cuda().train()
    v = model.config.vocab_size
    g = torch.Generator(device="cuda").manual_seed(0)
    succ = torch.cat([torch.arange(3, device="cuda"), torch.randperm(v - 3, generator=g, device="cuda") + 3])
    n_seq, length = 2048, 160
    x = torch.empty(n_seq, length, dtype=torch.long, device="cuda")
    x[:, 0] = torch.randint(3, v, (n_seq,), generator=g, device="cuda")
    noise = torch.rand(n_seq, length, generator=g, device="cuda") < 0.15
    rnd = torch.randint(3, v, (n_seq, length), generator=g, device="cuda")
    for t in range(1, length):
        x[:, t] = torch.where(noise[:, t], rnd[:, t], succ[x[:, t - 1]])
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    for step in range(300):
        batch = x[torch.randint(0, n_seq, (32,), generator=g, device="cuda")]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    print(f"trained: loss {loss.item():.3f} after 300 steps")
    model.eval().save_pretrained(d, safe_serialization=True)
    return d


def _compare_greedy(model_dir, prompts, steps=32, same_paths=True, decode_gemm="auto", ref_dir=None, max_num_seqs=16,
                    num_blocks=512, ref_patch=None, **engine_kw):
    """surge BF16 (CUDA graphs, overlapped steps) against transformers BF16 generate, and the BF16
    logits of a prefill against transformers FP32 (of ref_dir's weights where given: e.g. the FP8 round
    trip of model_dir's; ref_patch(model) changes both transformers models first, e.g. hooks that round a
    module's inputs as the engine does). Returns (equal, near_ties, other, logit_err, scale)."""
    from transformers import AutoModelForCausalLM

    from surge.engines.decoder import DecoderEngine
    from surge.engines.decoder.attention import AttnMeta

    engine = DecoderEngine(model_dir, device="cuda", dtype="bf16", num_blocks=num_blocks, max_num_seqs=max_num_seqs,
                           max_model_len=512, decode_gemm=decode_gemm, **engine_kw)
    if engine_kw.get("pdl"):
        from surge.engines.kernels import pdl

        assert engine.model.pdl == pdl.supported()
    if decode_gemm == "splitk":  # every layer GEMM of a decode step (unmeasured shapes: default_plan)
        assert len(engine.model._splitk) == 4 * engine.cfg.num_layers
    engine.warmup()
    ref_dir = ref_dir or model_dir
    hf32 = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).cuda().eval()
    hf16 = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.bfloat16).cuda().eval()
    if ref_patch is not None:
        ref_patch(hf32)
        ref_patch(hf16)
    # logits of whole prompts (prefill through the Triton kernel) against FP32
    err, scale = 0.0, 0.0
    for p in prompts[:4]:
        n = len(p)
        nb = -(-n // 16)
        meta = AttnMeta(torch.arange(n, device="cuda"), torch.arange(nb, dtype=torch.int32, device="cuda")[None],
                        torch.tensor([n], dtype=torch.int32, device="cuda"),
                        torch.tensor([0, n], dtype=torch.int32, device="cuda"), n, [n], [n], [list(range(nb))])
        with torch.no_grad():
            ours = engine.model.logits(engine.model.forward(torch.tensor(p, device="cuda"),
                                                            torch.arange(n, device="cuda"), engine.kv, meta))
            ref = hf32(torch.tensor([p], device="cuda")).logits[0].float()
        err = max(err, (ours - ref).abs().max().item())
        scale = max(scale, ref.abs().max().item())
    # greedy: the overlapped graph loop, and the host sampler with the top-2 logprobs (the margins)
    fast, overlapped = _run_overlapped(engine, prompts, steps, max_num_seqs=max_num_seqs)
    assert overlapped > 0
    tops: dict = {}
    got = _run(engine, prompts, steps, max_num_seqs=max_num_seqs, logprobs=2, tops=tops)
    if same_paths:  # (random weights: batches formed at other steps may flip BF16 near-ties)
        assert fast == got, "the overlapped CUDA-graph loop and the host sampler disagree"
    equal, near, other = 0, [], []
    for i, (p, g) in enumerate(zip(prompts, got)):
        out = hf16.generate(torch.tensor([p], device="cuda"), max_new_tokens=steps, do_sample=False,
                            eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        if out == g:
            equal += 1
            continue
        j = next(k for k, (a, b) in enumerate(zip(out, g)) if a != b)
        (lp1, lp2) = [v for _, v in tops[i][j]]
        margin = lp1 - lp2  # surge's top-2 logit gap where the two parted (same context up to there)
        (near if margin < 2 * err else other).append((i, j, round(margin, 4)))
    return equal, near, other, err, scale


@pytest.mark.parametrize("decode_gemm,decode_attention,pdl", [("auto", "fused", False), ("splitk", "fused", False),
                                                              ("auto", "split", False), ("auto", "fused", True),
                                                              ("splitk", "fused", True)])
def test_bf16_trained_model_greedy_equals_transformers(trained_dir, decode_gemm, decode_attention, pdl):
    """The issue's GPU test on a model with real margins: logits within tolerance of FP32, and greedy
    BF16 tokens equal to transformers' BF16 generate on all 32 steps for the bulk (>= 75%) of
    prompts; a prompt that parts is counted apart when it parts at a near-tie (top-2 gap below
    twice the measured BF16 logit error) and must not part anywhere else. "splitk": the decode
    steps' layer GEMMs through the split-K kernel and its fused readers; decode_attention "split": RoPE
    and attention in two kernels (session 8); pdl: programmatic dependent launch of the Triton kernels."""
    prompts = _prompts(384, 24)
    equal, near, other, err, scale = _compare_greedy(trained_dir, prompts, decode_gemm=decode_gemm,
                                                     decode_attention=decode_attention, pdl=pdl)
    print(f"trained model ({decode_gemm}, {decode_attention}, pdl={pdl}): {equal}/{len(prompts)} prompts equal on 32 greedy BF16 steps; "
          f"near-ties {near}; other {other}; max logit error {err:.4f} of scale {scale:.2f}")
    assert err < 0.05 * scale
    assert not other, f"divergences that are not near-ties: {other}"
    assert equal >= 0.75 * len(prompts), f"only {equal}/{len(prompts)} prompts equal"


def test_short_prompts_prefill_through_the_row_graphs(trained_dir):
    """graph_prefill_tokens (here 400): prompts joining a running batch, in steps of at most 400 tokens, replay the
    row graphs (every token a row attending to its sequence's cache up to itself; a 300-token prompt's step in two
    replays, 256 rows and the rest, the second reading the first's keys from the cache); a 450-token step runs
    eagerly. The BF16 greedy tokens equal transformers' BF16 generate on 32 steps for the bulk (>= 75%) of
    prompts, and each prompt's first-token top-2 log-probabilities are the eager engine's within BF16 rounding
    (the row path's attention and GEMMs are the decode step's, not the prefill's)."""
    from surge.engines.decoder import DecoderEngine
    from surge.runtime.scheduler import SamplingParams, Scheduler, SchedulerConfig, Sequence
    from surge.runtime.scheduler.overlap import StepLoop
    from tests.loop_driver import drive

    kw = dict(device="cuda", dtype="bf16", num_blocks=512, max_num_seqs=16, max_model_len=512)
    engine = DecoderEngine(trained_dir, graph_prefill_tokens=400, **kw)
    eager = DecoderEngine(trained_dir, graph_prefill_tokens=0, **kw)
    engine.warmup()
    eager.warmup()
    assert engine.row_graphs.buckets[-1] == 256 and set(engine.row_graphs.graphs) == set(engine.row_graphs.buckets)
    assert eager.row_graphs is None
    prompts = _prompts(384, 16)
    g = torch.Generator().manual_seed(9)
    prompts += [torch.randint(3, 384, (n,), generator=g).tolist() for n in (300, 450)]  # two replays; eager
    replayed, per_step, run_rows, prefill = [], [], engine.row_graphs.run, engine._prefill_graph

    def counted(ids, *a, **k):
        replayed.append(len(ids))
        per_step[-1] += 1
        return run_rows(ids, *a, **k)

    engine.row_graphs.run = counted
    engine._prefill_graph = lambda sc: per_step.append(0) or prefill(sc)

    def joined(e, logprobs=None):
        sched = Scheduler(SchedulerConfig(num_blocks=512, block_size=e.block_size, max_num_seqs=16,
                                          max_num_batched_tokens=512, max_model_len=512), ())
        seqs = [Sequence(i, p, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, logprobs=logprobs))
                for i, p in enumerate(prompts)]
        firsts, step = {}, e.step

        def keep_first(sc):
            out = step(sc)
            for sid, o in out.items():
                firsts.setdefault(sid, [v for _, v in o.top or []])
            return out

        e.step = keep_first
        drive(StepLoop(sched, e, steps=4), sched, seqs, [3 * i for i in range(len(prompts))])
        del e.step
        assert sched.blocks.num_free == 512
        return [s.output_ids for s in seqs], firsts

    got, _ = joined(engine)
    assert len(per_step) >= len(prompts) - 1 and max(replayed) == 256 and max(per_step) == 2, (per_step, replayed)
    hf16 = _hf_bf16(trained_dir)
    equal = 0
    for p, out in zip(prompts, got):
        ref = hf16.generate(torch.tensor([p], device="cuda"), max_new_tokens=32, do_sample=False, eos_token_id=None,
                            pad_token_id=0)[0, len(p):].tolist()
        equal += ref == out
    print(f"row-graph prefill: {equal}/{len(prompts)} prompts equal to transformers on 32 BF16 steps; "
          f"{len(per_step)} row-graph steps, replays of {sorted(set(replayed))} rows")
    assert equal >= 0.75 * len(prompts), f"only {equal}/{len(prompts)} prompts equal"
    _, rows_first = joined(engine, logprobs=2)
    _, eager_first = joined(eager, logprobs=2)
    for sid in range(len(prompts)):
        torch.testing.assert_close(rows_first[sid], eager_first[sid], atol=0.15, rtol=0)  # logits' BF16 ulps


def test_prompts_joining_launches_prefill_beside_them(trained_dir):
    """prefill_beside: prompts arriving while multi-step decode launches are in flight are prefilled on the
    engine's second stream while those launches still run (their last one not finished when the prompt's replay
    starts, for at least half of them), and join the next launch: all but a few of the 12 joining prompts go
    beside. The BF16 greedy tokens equal transformers' BF16 generate on 32 steps for the bulk (>= 75%) of
    prompts; the same loop without `beside` runs no beside step (how many prompts' tokens equal it is printed)."""
    from surge.engines.decoder import DecoderEngine
    from surge.runtime.scheduler import SamplingParams, Scheduler, SchedulerConfig, Sequence
    from surge.runtime.scheduler.overlap import StepLoop
    from tests.loop_driver import drive

    engine = DecoderEngine(trained_dir, device="cuda", dtype="bf16", num_blocks=512, max_num_seqs=16,
                           max_model_len=512, decode_steps=4)
    engine.warmup()
    assert engine.beside_stream is not None
    prompts = _prompts(384, 16)
    busy, beside = [], engine.prefill_beside

    def run(on: bool):
        sched = Scheduler(SchedulerConfig(num_blocks=512, block_size=engine.block_size, max_num_seqs=16,
                                          max_num_batched_tokens=512, max_model_len=512), ())
        seqs = [Sequence(i, p, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
                for i, p in enumerate(prompts)]
        loop = StepLoop(sched, engine, steps=4, beside=on)

        def watched(sc):  # was the newest launch in flight still running on the device?
            busy.append(not loop._inflight[-1][1].event.query())
            return beside(sc)

        engine.prefill_beside = watched
        drive(loop, sched, seqs, [0] * 4 + [4 + 2 * i for i in range(len(prompts) - 4)])
        del engine.prefill_beside
        assert sched.blocks.num_free == 512
        return [s.output_ids for s in seqs], loop.beside_steps

    got, steps = run(True)
    assert steps >= len(prompts) - 6 and len(busy) == steps and sum(busy) >= steps // 2, (steps, busy)
    plain, none = run(False)
    assert none == 0
    hf16 = _hf_bf16(trained_dir)
    equal = same = 0
    for p, out, out_plain in zip(prompts, got, plain):
        ref = hf16.generate(torch.tensor([p], device="cuda"), max_new_tokens=32, do_sample=False, eos_token_id=None,
                            pad_token_id=0)[0, len(p):].tolist()
        equal += ref == out
        same += out == out_plain
    print(f"prefill beside: {steps} steps ({sum(busy)} while the launches ran), {equal}/{len(prompts)} prompts "
          f"equal to transformers on 32 BF16 steps, {same} equal to the loop without it")
    assert equal >= 0.75 * len(prompts), f"only {equal}/{len(prompts)} prompts equal"


def _hf_bf16(d):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).cuda().eval()


def test_llama_1b_shapes_take_their_measured_plans(llama_1b_layers_dir, tmp_path):
    """With decode_gemm "auto" the engine runs Llama-1B's decode GEMMs through the measured plans (TMA
    split-K for qkv, o and down; the one-kernel SiLU(gate) * up), and its greedy BF16 tokens (PDL where
    supported) follow transformers as test_bf16_trained_model_greedy_equals_transformers asks. The decode
    attention takes the keys a tile measured for the heads (Qwen2-0.5B-like layouts: the default)."""
    from surge.engines.decoder import DecoderEngine
    from surge.engines.kernels import gate_up, splitk_gemm
    from tests.decoder_models import build_model

    e = DecoderEngine(llama_1b_layers_dir, device="cuda", dtype="bf16", num_blocks=64, max_num_seqs=4,
                      max_model_len=512, cuda_graphs=False)
    for i in range(e.cfg.num_layers):
        for name in ("qkv", "o", "down"):
            plan = e.model._splitk[f"l{i}.{name}"]
            assert plan == splitk_gemm.plan_for(*e.model.w[f"l{i}.{name}"].shape) and plan.tma, name
        assert e.model._gate_up[f"l{i}.up_gate"] == gate_up.plan_for(8192, 2048)
    assert e.model.decode_block_n == 128  # the decode attention's keys a tile measured for 32 / 8 heads
    del e
    from surge.engines.kernels.decode_attention import DEFAULT_BLOCK_N

    assert DecoderEngine(llama_1b_layers_dir, device="cuda", dtype="bf16", num_blocks=64, max_num_seqs=4,
                         max_model_len=512, cuda_graphs=False, decode_block_n=64).model.decode_block_n == 64
    qwen = build_model("qwen2", tmp_path / "qwen", hidden_size=896, intermediate_size=256, num_attention_heads=14,
                       num_key_value_heads=2)
    assert DecoderEngine(qwen, device="cuda", dtype="bf16", num_blocks=64, max_num_seqs=4,
                         cuda_graphs=False).model.decode_block_n == DEFAULT_BLOCK_N
    prompts = _prompts(384, 16)
    equal, near, other, err, scale = _compare_greedy(llama_1b_layers_dir, prompts, pdl=True)
    print(f"Llama-1B layers: {equal}/{len(prompts)} prompts equal on 32 greedy BF16 steps; near-ties {near}; "
          f"other {other}; max logit error {err:.4f} of scale {scale:.2f}")
    assert err < 0.05 * scale
    assert not other, f"divergences that are not near-ties: {other}"
    assert equal >= 0.75 * len(prompts), f"only {equal}/{len(prompts)} prompts equal"


def test_bf16_logits_and_greedy_tokens_follow_transformers(qwen_dir):
    """Random weights (near-uniform logits): logits within tolerance; prompts that part from
    transformers part at near-ties only (counted, not required to be few: random weights tie often)."""
    prompts = _prompts(384)
    equal, near, other, err, scale = _compare_greedy(qwen_dir, prompts, same_paths=False)
    print(f"random model: {equal}/{len(prompts)} prompts equal on 32 greedy BF16 steps; near-ties {near}; "
          f"other {other}; max logit error {err:.4f} of scale {scale:.2f}")
    assert err < 0.05 * scale
    assert not other, f"divergences that are not near-ties: {other}"


def test_cuda_graph_decode_equals_eager(qwen_dir):
    from surge.engines.decoder import DecoderEngine

    prompts = _prompts(384, 10)
    a = DecoderEngine(qwen_dir, device="cuda", dtype="fp32", num_blocks=512, max_num_seqs=16, max_model_len=512)
    a.warmup()
    assert a.graphs is not None and a.graphs.graphs
    b = DecoderEngine(qwen_dir, device="cuda", dtype="fp32", num_blocks=512, max_num_seqs=16, max_model_len=512,
                      cuda_graphs=False)
    want = _run(b, prompts, 24)
    assert _run(a, prompts, 24) == want
    got, overlapped = _run_overlapped(a, prompts, 24)
    assert got == want and overlapped > 10


def test_next_decode_inputs_kernel_equals_torch():
    """The multi-step graphs' input kernel writes what its torch reference writes, rows past n untouched."""
    from surge.engines.decoder.graphs import next_decode_inputs_torch
    from surge.engines.kernels.decode_inputs import next_decode_inputs

    g = torch.Generator(device="cuda").manual_seed(0)
    for n, cols, width, bs in [(1, 1, 8, 16), (5, 64, 8, 16), (64, 64, 20, 16), (200, 256, 33, 4)]:
        packed = torch.randint(0, 10_000, (5, cols + 3), device="cuda", generator=g)
        packed[1] = torch.randint(0, width * bs - 1, (cols + 3,), device="cuda", generator=g)
        tables = torch.randint(0, 5000, (cols + 3, width), device="cuda", dtype=torch.int32, generator=g)
        want, got = packed.clone(), packed.clone()
        next_decode_inputs_torch(want, tables, n, bs)
        next_decode_inputs(got, tables, n, bs)
        assert torch.equal(got, want), (n, cols, width, bs)
        assert torch.equal(got[:, n:], packed[:, n:])


@pytest.mark.parametrize("steps", [4, 5])
def test_multi_step_launches_equal_eager(qwen_dir, steps):
    """Launches of several decode steps (each graph replay making the next one's inputs on the device)
    give the eager engine's greedy tokens, prompts of different lengths and max_tokens that are not
    multiples of the launch."""
    from surge.engines.decoder import DecoderEngine

    prompts = _prompts(384, 10)
    a = DecoderEngine(qwen_dir, device="cuda", dtype="fp32", num_blocks=512, max_num_seqs=16, max_model_len=512,
                      decode_steps=steps)
    a.warmup()
    b = DecoderEngine(qwen_dir, device="cuda", dtype="fp32", num_blocks=512, max_num_seqs=16, max_model_len=512,
                      cuda_graphs=False)
    want = _run(b, prompts, 23)
    loops = []
    got, overlapped = _run_overlapped(a, prompts, 23, steps=steps, loops=loops)
    assert got == want
    assert loops[0].steps >= 3 * (overlapped + 1), "launches must run several decode steps"
    # each bucket timed its step after capture; decode_launch_ms caps a launch by those times
    from surge.runtime.scheduler import SamplingParams, Sequence
    from surge.runtime.scheduler.step import ScheduledSeq

    assert set(a.graphs.step_us) == set(a.graphs.buckets) and all(t > 0 for t in a.graphs.step_us.values())
    seq = Sequence(0, [5, 6, 7], SamplingParams(max_tokens=8, temperature=0.0))
    seq.block_table = [0]
    one = [ScheduledSeq(seq, 2, 1, True)]
    a.decode_launch_ms = None
    assert a.launch_steps(one) == steps
    a.decode_launch_ms = 2.5 * a.graphs.step_us[1] / 1e3
    assert a.launch_steps(one) == 2
    a.decode_launch_ms = 1e-6
    assert a.launch_steps(one) == 1


@pytest.mark.parametrize("engine_process", [False, True])
def test_service_streams_multi_step_launches(qwen_dir, engine_process):
    """The generation service on the GPU with 4 decode steps a launch, its engine loop on a thread or in
    a process of its own (the GPU's default): each stream's deltas add up to the eager engine's greedy
    tokens, cut at stop tokens found inside a launch; the non-streamed answer is the same; the loop ran
    multi-step launches. At most one prompt may part from the eager tokens, and only at an FP32 near-tie
    of transformers' own logits."""
    import asyncio
    import time

    from surge.engines.decoder import DecoderEngine
    from surge.runtime.generate_service import GenerationConfig
    from surge.runtime.generate_load import load_generate_service
    from surge.runtime.scheduler import SamplingParams

    prompts = _prompts(384, 12)
    eager = DecoderEngine(qwen_dir, device="cuda", dtype="fp32", num_blocks=512, max_num_seqs=16, max_model_len=512,
                          cuda_graphs=False)
    want = _run(eager, prompts, 21)
    del eager
    svc = load_generate_service(qwen_dir, "q", device="cuda", precision="fp32",
                                config=GenerationConfig(decode_steps=4, max_num_seqs=16, max_model_len=512,
                                                        cache_entries=0, prefix_caching=False,
                                                        engine_process=engine_process))
    svc.mark_ready()
    assert svc.remote == engine_process
    if not engine_process:
        assert svc.engine.graphs.steps == 4 and svc.loop.max_steps == 4

    def params(i):
        return SamplingParams(max_tokens=21, temperature=0.0, ignore_eos=True,
                              stop_token_ids=(want[i][9],) if i % 3 == 0 else ())

    async def main():
        async def one(i, p):
            toks = []
            async for d in svc.stream(p, params(i), deadline=time.monotonic() + 120):
                toks += d.token_ids
            return toks

        streamed = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        whole = await asyncio.gather(*(svc.generate(p, params(i), deadline=time.monotonic() + 120)
                                       for i, p in enumerate(prompts)))
        stats = svc.stats()
        await svc.close()
        return streamed, whole, stats

    streamed, whole, stats = asyncio.run(main())
    hf, apart = None, []
    for i, w in enumerate(want):
        exp = w[: w.index(w[9]) + 1] if i % 3 == 0 else w
        if streamed[i] != exp or whole[i].token_ids != exp:
            # FP32 GEMMs of other batch shapes (the engine process batches its arrivals as they come) sum in
            # another order: a token may flip where transformers' own top two are a rounding apart, and only
            # there (session 34's call 5 met one at prompt 4's 11th token, once in ~10 runs)
            got = streamed[i] if streamed[i] != exp else whole[i].token_ids
            k = next(j for j in range(min(len(got), len(exp)) + 1) if j == len(got) or got[j] != exp[j])
            hf = hf or _hf_cuda(qwen_dir)
            with torch.no_grad():
                top = hf(torch.tensor([prompts[i] + exp[:k]], device="cuda")).logits[0, -1].topk(2).values
            assert float(top[0] - top[1]) < 1e-3, (f"prompt {i}", k, top.tolist())
            apart.append(i)
            continue
        assert whole[i].finish_reason == ("stop" if i % 3 == 0 else "length")
    assert len(apart) <= 1, apart
    assert stats["steps"] >= 2 * stats["overlapped_steps"] > 0, "launches must run several decode steps"


def test_the_shared_engine_loop_streams_as_the_service_does(trained_dir, tmp_path, monkeypatch):
    """`--workers`' shared engine loop on the GPU, in this process: a decoder build behind its own socket
    (cli/workers_generate.HubBuild: CUDA graphs, 4 decode steps a launch) and two front ends' services
    streaming through it (runtime/generate_hub.HubClient) give each prompt the tokens of the service with its
    loop on a thread, same settings, though both front ends number their sequences from 1. BF16 (a decoder
    runs in BF16 on a GPU unless a precision is set, loader.generate_settings) on the trained model: the
    front ends' requests reach the engine in another order, so batches are made up differently and a
    near-tie may part a prompt late (the suite's BF16 rule: the bulk equal); a token routed to the wrong
    sequence would part every prompt at once."""
    import asyncio
    import secrets
    import time
    from types import SimpleNamespace

    from surge.cli.workers_generate import HubBuild, front_generator, retire
    from surge.config import EngineConfig
    from surge.models import load_model_spec
    from surge.runtime.generate_hub import AUTHKEY_ENV
    from surge.runtime.generate_service import GenerationConfig
    from surge.runtime.generate_load import load_generate_service
    from surge.runtime.scheduler import SamplingParams

    monkeypatch.setenv(AUTHKEY_ENV, secrets.token_hex(32))
    prompts = _prompts(384, 12)
    gen = GenerationConfig(decode_steps=4, max_num_seqs=16, max_model_len=512, cache_entries=0, prefix_caching=False,
                           engine_process=False)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)

    async def streams(services):
        async def one(i, p):
            toks = []
            async for d in services[i % len(services)].stream(p, params, deadline=time.monotonic() + 120):
                toks += d.token_ids
            return toks
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

    thread = load_generate_service(trained_dir, "q", device="cuda", precision="bf16", config=gen)
    thread.mark_ready()

    async def on_thread():
        out = await streams([thread])
        await thread.close()
        return out

    want = asyncio.run(on_thread())
    thread = None  # its engine's memory back before the build's
    torch.cuda.empty_cache()
    build = HubBuild(load_model_spec(trained_dir, name="q"), "1", EngineConfig(device="cuda"), gen, str(tmp_path),
                     120.0)
    build.mark_ready()
    from surge.config import CacheConfig

    config = SimpleNamespace(limits=SimpleNamespace(request_timeout_s=120.0), cache=CacheConfig())

    async def shared():
        fronts = [await front_generator(config, build.catalog_entry()) for _ in range(2)]
        for f in fronts:
            f.mark_ready()
        out = await streams(fronts)
        stats = fronts[0].stats()
        for f in fronts:
            await retire(f)
        await build.close()
        return out, stats

    got, stats = asyncio.run(shared())
    assert all(g[:8] == w[:8] for g, w in zip(got, want)), (got, want)
    assert sum(g == w for g, w in zip(got, want)) >= 0.75 * len(want), (got, want)
    assert stats["steps"] >= 2 * stats["overlapped_steps"] > 0, "launches must run several decode steps"


def test_fused_decode_attention_and_pdl_change_no_bit(qwen_dir):
    """The engine's decode steps with RoPE + attention in one kernel, and with PDL launches, give the
    session-8 engine's (two kernels, plain launches) tokens and top-5 log-probabilities exactly, through
    CUDA graphs and the overlapped loop, on prompts of different lengths joining one batch."""
    from surge.engines.decoder import DecoderEngine

    prompts = _prompts(384, 14)
    runs = {}
    for attn, pdl in (("split", False), ("fused", False), ("fused", True)):
        e = DecoderEngine(qwen_dir, device="cuda", dtype="bf16", num_blocks=512, max_num_seqs=16, max_model_len=512,
                          decode_attention=attn, pdl=pdl)
        e.warmup()
        tops: dict = {}
        got = _run(e, prompts, 40, logprobs=5, tops=tops)
        fast, _ = _run_overlapped(e, prompts, 40)
        runs[attn, pdl] = (got, fast, tops)
        del e
    ref = runs["split", False]
    for key, val in runs.items():
        assert val[0] == ref[0] and val[1] == ref[1], key
        assert val[2] == ref[2], key


def test_l2_prefetch_changes_no_bit(qwen_dir):
    """Weights asked into L2 from a side stream (kernels/l2_prefetch.py) are only a hint: the engine's
    tokens and top-5 log-probabilities equal the engine's without it (both plans), through CUDA graphs and
    the overlapped loop, on prompts of different lengths joining one batch. A GPU without the bulk prefetch
    (compute capability < 9) runs without the side stream and gives the same tokens."""
    from surge.engines.decoder import DecoderEngine
    from surge.engines.kernels import l2_prefetch

    prompts = _prompts(384, 14)
    runs = {}
    for pf in (False, True, "staggered"):
        e = DecoderEngine(qwen_dir, device="cuda", dtype="bf16", num_blocks=512, max_num_seqs=16, max_model_len=512,
                          l2_prefetch=pf)
        assert (e.model._pf_stream is not None) == (bool(pf) and l2_prefetch.supported())
        e.warmup()
        tops: dict = {}
        got = _run(e, prompts, 40, logprobs=5, tops=tops)
        fast, _ = _run_overlapped(e, prompts, 40)
        runs[pf] = (got, fast, tops)
        del e
    assert runs[True] == runs[False] and runs["staggered"] == runs[False]
    with pytest.raises(ValueError, match="l2_prefetch must be"):
        DecoderEngine(qwen_dir, device="cuda", dtype="bf16", num_blocks=64, max_num_seqs=4, max_model_len=512,
                      cuda_graphs=False, l2_prefetch="early")


@pytest.mark.parametrize("sizes", [(1,), (7, 8193), (3 * 2 ** 20 + 5, 16, 2 ** 21, 999)])
def test_bulk_prefetch_runs_on_any_size_and_leaves_data(sizes):
    """bulk_prefetch launches over tensors of any length (below 16 bytes, past a chunk's end, up to four)
    inside a captured graph and outside, and the tensors keep their values."""
    from surge.engines.kernels.l2_prefetch import bulk_prefetch

    ts = [torch.randn(n, device="cuda").to(torch.bfloat16) for n in sizes]
    before = [t.clone() for t in ts]
    bulk_prefetch(ts)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
        bulk_prefetch(ts)
    g.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(ts, before))
    with pytest.raises(ValueError, match="at most 4"):
        bulk_prefetch(ts * 5)
    with pytest.raises(ValueError, match="contiguous"):
        bulk_prefetch([torch.zeros(64, 64, device="cuda").t()])


@pytest.mark.parametrize("dtype,tol", [("fp32", 0.03), ("bf16", 0.15)])  # fp32: Triton dots in TF32
def test_prompt_logprobs_follow_transformers(qwen_dir, dtype, tol):
    """OpenAI's echo with logprobs on the GPU (the varlen prefill, a 64-token budget so prompts are chunked,
    CUDA graphs captured for the decode): every prompt token from the second scored once, within tolerance
    of transformers' FP32 forward (BF16: the model's own rounding)."""
    from transformers import AutoModelForCausalLM

    from surge.engines.decoder import DecoderEngine
    from surge.runtime.scheduler import SamplingParams, Scheduler, SchedulerConfig, Sequence

    prompts = _prompts(384, 6)
    engine = DecoderEngine(qwen_dir, device="cuda", dtype=dtype, num_blocks=512, max_num_seqs=16, max_model_len=512)
    engine.warmup()
    sched = Scheduler(SchedulerConfig(num_blocks=engine.num_blocks, block_size=engine.block_size, max_num_seqs=16,
                                      max_num_batched_tokens=64, max_model_len=512), ())
    seqs = [Sequence(i, p, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=2))
            for i, p in enumerate(prompts)]
    for s in seqs:
        sched.add(s)
    got = {}
    while sched.has_work:
        scheduled = sched.schedule()
        outs = engine.step(scheduled)
        got.update({k: v.prompt for k, v in outs.items() if v.prompt is not None})
        sched.update(scheduled, {k: v.token for k, v in outs.items()})
    hf = AutoModelForCausalLM.from_pretrained(qwen_dir, dtype=torch.float32).cuda().eval()
    for i, p in enumerate(prompts):
        with torch.no_grad():
            lp = torch.log_softmax(hf(torch.tensor([p], device="cuda")).logits[0, :-1].double(), dim=-1)
        want = lp.gather(1, torch.tensor(p[1:], device="cuda")[:, None])[:, 0].tolist()
        assert [t for t, *_ in got[i]] == p[1:] and all(len(top) == 2 for _, _, top, _ in got[i])
        assert [v for _, v, *_ in got[i]] == pytest.approx(want, abs=tol)
        assert all(isinstance(rank, int) and rank >= 1 for *_, rank in got[i])


def test_guided_rows_on_the_gpu_equal_the_eager_engine(tmp_path_factory):
    """Structured outputs on CUDA: guided rows (a JSON schema, a regex, choices, a grammar; greedy) and
    unguided neighbours in the service's loop (CUDA graphs, 4 decode steps a launch while no guided row
    runs) give the eager engine's tokens (FP32), and the guided answers that finish match their
    constraint: the mask reaches the device's logits and the matcher takes the tokens the graphs chose."""
    import json
    import re

    from tokenizers import Tokenizer

    from surge.engines.decoder import DecoderEngine
    from surge.runtime.guided import guide_for
    from surge.runtime.scheduler import SamplingParams, Scheduler, SchedulerConfig, Sequence
    from surge.runtime.scheduler.overlap import StepLoop
    from tests.decoder_models import build_model

    d = build_model("qwen2", tmp_path_factory.mktemp("guided_gpu"), seed=3, vocab=512, all_bytes=True,
                    hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                    num_key_value_heads=2, max_position_embeddings=512)
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    schema = {"type": "object", "properties": {"color": {"enum": ["red", "blue"]}, "ok": {"type": "boolean"}},
              "required": ["color", "ok"], "additionalProperties": False}
    guides = [guide_for("json", schema, "x"), guide_for("regex", r"[0-9]{2}-[a-z]{2,4}", "x"),
              guide_for("choice", ["alpha", "beta", "gamma"], "x"),
              guide_for("grammar", 'start: "[" /[a-c]{1,3}/ ("," /[a-c]{1,3}/){0,2} "]"', "x")]
    checks = [lambda t: set(json.loads(t)) == {"color", "ok"}, lambda t: re.fullmatch(r"[0-9]{2}-[a-z]{2,4}", t),
              lambda t: t in ("alpha", "beta", "gamma"), lambda t: re.fullmatch(r"\[[a-c]{1,3}(,[a-c]{1,3}){0,2}\]", t)]
    texts = ["Give me JSON please", "The code", "Pick a name", "A list of letters"]

    def run(engine, overlapped: bool):
        sched = Scheduler(SchedulerConfig(num_blocks=engine.num_blocks, block_size=engine.block_size, max_num_seqs=16,
                                          max_num_batched_tokens=512, max_model_len=512), engine.cfg.eos_token_ids)
        seqs = [Sequence(i, tok.encode(texts[i % 4] + " " * (i // 4)).ids,
                         SamplingParams(max_tokens=40, temperature=0.0, guide=guides[i % 4] if i < 8 else None,
                                        ignore_eos=i >= 8)) for i in range(14)]
        for s in seqs[8:]:  # the unguided rows decode on their own first (graph launches), then the guided join
            sched.add(s)
        loop = StepLoop(sched, engine, steps=4) if overlapped else None
        for _ in range(6):
            loop.step() if overlapped else sched.update(sch := sched.schedule(),
                                                        {k: v.token for k, v in engine.step(sch).items()})
        for s in seqs[:8]:
            sched.add(s)
        while sched.has_work:
            if overlapped:
                loop.step()
            else:
                sch = sched.schedule()
                sched.update(sch, {k: v.token for k, v in engine.step(sch).items()})
        return seqs, loop

    a = DecoderEngine(d, device="cuda", dtype="fp32", num_blocks=512, max_num_seqs=16, max_model_len=512,
                      decode_steps=4)
    a.warmup()
    b = DecoderEngine(d, device="cuda", dtype="fp32", num_blocks=512, max_num_seqs=16, max_model_len=512,
                      cuda_graphs=False)
    got, loop = run(a, True)
    want, _ = run(b, False)
    assert [s.output_ids for s in got] == [s.output_ids for s in want]
    assert loop.overlapped > 0, "the unguided rows alone must have taken graph launches"
    done = 0
    for i, s in enumerate(got[:8]):
        if s.finish_reason == "stop":
            done += 1
            text = tok.decode(s.output_ids)
            assert checks[i % 4](text), (i, text)
    assert done >= 5


def test_a_decoder_runs_the_precision_that_is_set(qwen_dir):
    """`--precision fp32` (set) builds an FP32 decoder on the GPU, the field's default a BF16 one (the
    loader's rule, as the server builds a model), and the FP32 one's greedy tokens are the FP32 eager
    engine's."""
    import asyncio

    from surge.config import EngineConfig, GenerationConfig, LimitsConfig
    from surge.engines.decoder import DecoderEngine
    from surge.models import load_model_spec
    from surge.runtime.loader import build_generate_service
    from surge.runtime.scheduler import SamplingParams

    spec = load_model_spec(qwen_dir, name="q")
    prompts = _prompts(384, 4)

    async def answers(service):
        service.mark_ready()
        try:
            return [(await service.generate(p, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
                     ).token_ids for p in prompts]
        finally:
            await service.close()

    for cfg, dtype in ((EngineConfig(engine="torch", device="cuda", precision="fp32"), torch.float32),
                       (EngineConfig(engine="torch", device="cuda"), torch.bfloat16)):
        # the engine on a thread of this process (a GPU's default is its own process) to read its dtype
        service = build_generate_service(spec, "1", cfg, LimitsConfig(), GenerationConfig(engine_process=False))
        assert service.engine.dtype == dtype
        got = asyncio.run(answers(service))
        if dtype == torch.float32:
            eager = DecoderEngine(qwen_dir, device="cuda", dtype="fp32", num_blocks=512, max_num_seqs=16,
                                  max_model_len=512, cuda_graphs=False)
            assert got == _run(eager, prompts, 12)


@pytest.mark.parametrize("kind", ["qwen3", "granite"])
def test_the_unfused_layer_on_the_gpu(tmp_path_factory, kind):
    """Qwen3 (per-head q/k norms) and Granite (o and MLP biases), which the fused kernels lack, on CUDA: the
    unfused layer (its GEMMs, RoPE and Triton paged attention as separate kernels) in FP32 gives
    transformers' greedy tokens but where transformers' own top two are within TF32's rounding, and the
    service's loop (CUDA graphs, multi-step launches) gives the eager steps' tokens."""
    from transformers import AutoModelForCausalLM

    from surge.engines.decoder import DecoderEngine
    from tests.decoder_models import build_model

    extra = {"head_dim": 64} if kind == "qwen3" else {}
    d = build_model(kind, tmp_path_factory.mktemp(kind + "_gpu"), seed=5, hidden_size=256, intermediate_size=512,
                    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                    **extra)
    engine = DecoderEngine(d, device="cuda", dtype="fp32", num_blocks=512, max_num_seqs=16, max_model_len=512)
    assert not engine.model.fused
    engine.warmup()
    prompts = _prompts(384, 8)
    eager = _run(engine, prompts, 12)
    graphed, overlapped = _run_overlapped(engine, prompts, 12, steps=4)
    assert graphed == eager and overlapped > 0
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).cuda().eval()
    for p, out in zip(prompts, eager):
        ids = torch.tensor([p + out], device="cuda")
        with torch.no_grad():
            logits = hf(ids).logits[0, len(p) - 1:-1]
        agree = (logits.argmax(-1).tolist() == out)
        margin = logits.topk(2).values
        # a greedy token differs only where transformers' own top two are within TF32's rounding
        assert agree or bool(((margin[:, 0] - margin[:, 1]) < 0.05).any()), p


@pytest.mark.parametrize("dtype,fused", [("fp32", False), ("bf16", False), ("bf16", True)])
def test_lora_adapters_on_the_gpu(tmp_path_factory, dtype, fused):
    """Two peft adapters and the base model mixed in every batch on CUDA (CUDA graphs, multi-step launches),
    on the unfused layer and the fused one (at decode sizes the deltas joined inside the split-K GEMMs and
    the one-kernel gate/up; prefill chunks on the two delta kernels): the service's loop gives the eager steps' tokens; in FP32 each row follows
    transformers + peft with its adapter (each chosen token within TF32's rounding of peft's best), in BF16
    within BF16's; the same tokens under another adapter's weights are far off. With slots, base-model batches
    replay graphs without the adapters' GEMMs, batches with adapter rows the LoRA set."""
    pytest.importorskip("peft")
    from surge.engines.decoder import DecoderEngine
    from tests.decoder_models import build_lora, build_model, load_peft

    root = tmp_path_factory.mktemp("lora_gpu_" + dtype)
    d = build_model("qwen2", root / "base", seed=6, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    adapters = [build_lora(d, root / "a1", seed=1, r=16, scale=1.0),
                build_lora(d, root / "a2", seed=2, r=8, targets=["q_proj", "v_proj", "down_proj"], scale=2.0)]
    engine = DecoderEngine(d, device="cuda", dtype=dtype, num_blocks=512, max_num_seqs=16, max_model_len=512,
                           max_loras=2, max_lora_rank=16, decode_steps=4, fused=fused,
                           decode_gemm="splitk" if fused else "auto")
    for k, a in enumerate(adapters, 1):
        engine.load_adapter(k, a)
    assert engine.model.fused == fused
    joined = []  # the GEMM kernels that took LoRA operands
    for attr in ("_partials", "_gate_up_silu") if fused else ():
        def spy(*args, _real=getattr(engine.model, attr), _name=attr, **kw):
            if kw.get("lora") is not None:
                joined.append(_name)
            return _real(*args, **kw)
        setattr(engine.model, attr, spy)
    engine.warmup()
    prompts = _prompts(384, 9)
    slots = [i % 3 for i in range(len(prompts))]
    eager = _run(engine, prompts, 12, adapters=slots)
    assert set(joined) == ({"_partials", "_gate_up_silu"} if fused else set())
    graphed, overlapped = _run_overlapped(engine, prompts, 12, steps=4, adapters=slots)
    assert graphed == eager and overlapped > 0
    # base rows alone: the graphs without the adapters' GEMMs
    assert _run_overlapped(engine, prompts[:4], 12, steps=4)[0] == _run(engine, prompts[:4], 12)
    refs = [_hf_cuda(d)] + [load_peft(d, a).cuda() for a in adapters]
    # every token the engine chose is within `tol` of peft's FP32 best logit on the same prefix (FP32: TF32's
    # rounding; BF16: its rounding over the layers); under another adapter's weights the gaps are far larger
    tol = 0.05 if dtype == "fp32" else 0.75
    wrong = 0
    for p, out, slot in zip(prompts, eager, slots):
        ids = torch.tensor([p + out], device="cuda")
        chosen = torch.tensor(out, device="cuda")[:, None]
        gaps = []
        for model in (refs[slot], refs[(slot + 1) % 3]):
            with torch.no_grad():
                logits = model(ids).logits[0, len(p) - 1:-1].float()
            gaps.append(float((logits.max(-1).values - logits.gather(1, chosen)[:, 0]).max()))
        assert gaps[0] <= tol, (slot, p, gaps)
        wrong += gaps[1] > tol
    assert wrong >= len(prompts) - 2, "the rows must tell the adapters apart"


def _hf_cuda(d):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).cuda().eval()


@pytest.mark.parametrize("graphs", [True, False])
def test_speculative_steps_follow_plain_decoding(trained_dir, graphs):
    """n-gram speculation on the GPU (BF16, the loop the service runs: multi-step launches where no
    sequence has drafts): a sequence's input and drafts are rows of one step, replayed from the CUDA
    graph of the rows' bucket (or eagerly), each row attending to its sequence's cache up to itself
    (the fused one-kernel decode attention is off for such rows: they read each other's fresh K/V).
    The greedy tokens are those of the eager engine without drafts for the bulk of prompts, as the
    BF16 test above asks of transformers (batches of other sizes may flip BF16 near-ties), and most
    drafts are accepted (the prompts quote the answer)."""
    from surge.engines.decoder import DecoderEngine
    from surge.runtime.scheduler.ngram import NgramProposer

    plain = DecoderEngine(trained_dir, device="cuda", dtype="bf16", num_blocks=512, max_num_seqs=16,
                          max_model_len=512, cuda_graphs=False)
    # a prompt that quotes what the model will say (as a RAG answer quotes its context): p, then
    # p's greedy continuation, then p again
    first = _prompts(384, 24)
    prompts = [p + c + p for p, c in zip(first, _run(plain, first, 40))]
    want = _run(plain, prompts, 40)
    engine = DecoderEngine(trained_dir, device="cuda", dtype="bf16", num_blocks=512, max_num_seqs=16,
                           max_model_len=512, cuda_graphs=graphs, speculative_tokens=3, decode_steps=4)
    engine.warmup()
    assert bool(engine.row_graphs and engine.row_graphs.graphs) == graphs
    if graphs:  # the speculative rows (16 x 4) or the prompt steps' replays (ROW_GRAPH_ROWS), whichever is more
        from surge.engines.decoder.runner import ROW_GRAPH_ROWS

        assert engine.row_graphs.buckets[-1] == max(16 * 4, min(engine.graph_prefill_tokens, ROW_GRAPH_ROWS)) == 256
    got, loop = _run_speculating(engine, prompts, 40, NgramProposer(3, 2, 4))
    equal = sum(a == b for a, b in zip(got, want))
    print(f"speculation (graphs={graphs}): {equal}/{len(prompts)} prompts equal to plain decoding on 40 BF16 "
          f"steps; {loop.spec_steps} speculative steps of {loop.steps}, {loop.accepted}/{loop.drafted} drafts "
          f"accepted")
    assert all(len(g) == 40 for g in got)
    assert loop.spec_steps > 10 and loop.accepted > 0.5 * loop.drafted
    assert equal >= 0.75 * len(prompts), f"only {equal}/{len(prompts)} prompts equal"


def test_speculative_sampled_rows_draw_as_plain_sampling(trained_dir):
    """Seeded sampled sequences with n-gram speculation on the GPU (CUDA generators put back after a step
    that kept fewer drafts than it drew for): each draft row draws as plain sampling would at its
    position, so the answers are those of the engine without drafts, for the bulk of prompts (BF16
    logits of other batch shapes may move a draw at a near-tie), and drafts are accepted."""
    from surge.engines.decoder import DecoderEngine
    from surge.runtime.scheduler.ngram import NgramProposer

    kw = dict(device="cuda", dtype="bf16", num_blocks=512, max_num_seqs=16, max_model_len=512)
    plain = DecoderEngine(trained_dir, cuda_graphs=False, **kw)
    first = _prompts(384, 16)
    prompts = [p + c + p for p, c in zip(first, _run(plain, first, 30))]
    want, _ = _run_speculating(plain, prompts, 30, None, temperature=0.7)
    engine = DecoderEngine(trained_dir, speculative_tokens=3, **kw)
    engine.warmup()
    got, loop = _run_speculating(engine, prompts, 30, NgramProposer(3, 2, 4), temperature=0.7)
    equal = sum(a == b for a, b in zip(got, want))
    print(f"sampled speculation: {equal}/{len(prompts)} prompts equal to plain sampling on 30 BF16 steps; "
          f"{loop.spec_steps} speculative steps, {loop.accepted}/{loop.drafted} drafts accepted")
    assert loop.spec_steps > 5 and loop.accepted > 0.3 * loop.drafted
    assert equal >= 0.75 * len(prompts), f"only {equal}/{len(prompts)} prompts equal"


def test_a_draft_model_on_the_gpu(trained_dir, tmp_path):
    """Draft-model speculation on the GPU: the draft (here the model's own weights) decodes its k tokens in
    one multi-step graph launch, in blocks numbered as the target's, after a catch-up prefill; the target
    checks them from its graphs of draft rows. The answers are the eager engine's without drafts for the
    bulk of prompts (BF16 batches of other shapes), and nearly every draft is accepted."""
    import shutil

    from surge.engines.decoder import DecoderEngine
    from surge.runtime.scheduler.draft_model import DraftModelProposer

    draft = tmp_path / "draft"
    shutil.copytree(trained_dir, draft)
    kw = dict(device="cuda", dtype="bf16", num_blocks=512, max_num_seqs=16, max_model_len=512)
    plain = DecoderEngine(trained_dir, cuda_graphs=False, **kw)
    prompts = _prompts(384, 12)
    want = _run(plain, prompts, 30)
    engine = DecoderEngine(trained_dir, speculative_tokens=3, speculative_model=draft, **kw)
    engine.warmup()
    assert engine.draft.graphs.steps == 3 and engine.draft.graphs.graphs
    got, loop = _run_speculating(engine, prompts, 30, DraftModelProposer(engine.draft, 3))
    equal = sum(a == b for a, b in zip(got, want))
    print(f"draft model: {equal}/{len(prompts)} prompts equal to plain decoding on 30 BF16 steps; "
          f"{loop.spec_steps} speculative steps, {loop.accepted}/{loop.drafted} drafts accepted")
    assert loop.spec_steps >= 5 and loop.accepted > 0.8 * loop.drafted
    assert equal >= 0.75 * len(prompts), f"only {equal}/{len(prompts)} prompts equal"


def test_decoder_graphs_are_captured_while_another_engine_serves(qwen_dir, model_dir, tokenizer, sentences):
    """A decoder's CUDA graphs captured while an encoder serves batches on another thread (a model loaded, or
    reloaded without downtime, beside one that serves): the other thread's synchronizes and allocations must
    neither fail the capture nor fail themselves (engines/graph_capture.py: thread-local capture mode), and both
    engines keep their answers: the encoder its batch's bits, the decoder the eager engine's greedy tokens."""
    import threading
    import time

    import numpy as np
    import torch

    from surge.engines.decoder import DecoderEngine
    from surge.engines.torch_gpu import TorchEngine
    from surge.types import TokenBatch

    enc = TorchEngine(device="cuda", precision="fp16", max_batch=16)
    enc.load(model_dir)
    batch = TokenBatch.pack(tokenizer.encode(sentences[:16]))
    want = enc.run(batch)
    stop, errors, runs = threading.Event(), [], [0]

    def serve():
        while not stop.is_set():
            try:
                got = enc.run(batch)
                # a stream's synchronize, as the engines wait for their work (events, streams): a device-wide one
                # (cudaDeviceSynchronize) from any thread invalidates a capture open on another, thread-local mode
                # or not (measured on the H100, session 47), so no engine makes one while serving
                torch.cuda.current_stream().synchronize()
                torch.empty(1 << 20, device="cuda")  # an allocation, as a serving engine's first batch of a shape
            except Exception as exc:  # noqa: BLE001 - the test reports it
                errors.append(exc)
                return
            if not np.array_equal(got, want):
                errors.append(AssertionError("the encoder's answer changed"))
                return
            runs[0] += 1

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while runs[0] == 0 and not errors and time.monotonic() < deadline:
            time.sleep(0.01)
        before = runs[0]
        a = DecoderEngine(qwen_dir, device="cuda", dtype="fp32", num_blocks=512, max_num_seqs=16, max_model_len=512,
                          decode_steps=4)
        a.warmup()
        during = runs[0] - before
    finally:
        stop.set()
        thread.join(timeout=60)
    assert not errors, errors
    assert during >= 1, "the encoder must have served while the decoder captured"
    prompts = _prompts(384, 6)
    b = DecoderEngine(qwen_dir, device="cuda", dtype="fp32", num_blocks=512, max_num_seqs=16, max_model_len=512,
                      cuda_graphs=False)
    got, _ = _run_overlapped(a, prompts, 12, steps=4)
    assert got == _run(b, prompts, 12)


def test_a_capture_survives_the_collector_freeing_an_earlier_engine(qwen_dir):
    """An engine whose CUDA graphs only the garbage collector frees (left in a reference cycle, as a test's or a
    retired model's can be), collected while another engine captures its graphs (collections made frequent): the
    capture must not fail (engines/graph_capture.capture: no automatic collection while a capture is open), and the
    new engine's greedy tokens are the eager engine's."""
    import gc

    from surge.engines.decoder import DecoderEngine

    def engine(**kw):
        return DecoderEngine(qwen_dir, device="cuda", dtype="fp32", num_blocks=512, max_num_seqs=16,
                             max_model_len=512, **kw)

    for _ in range(3):  # a few engines' graphs and pools waiting for the collector
        old = engine(decode_steps=4)
        old.warmup()
        cycle = {"engine": old}
        cycle["self"] = cycle
        del old, cycle
    threshold = gc.get_threshold()
    gc.set_threshold(1, 1, 1)  # a full collection within a few allocations: inside the captures below
    try:
        new = engine(decode_steps=4)
        new.warmup()
    finally:
        gc.set_threshold(*threshold)
        gc.collect()
    prompts = _prompts(384, 6)
    got, _ = _run_overlapped(new, prompts, 12, steps=4)
    assert got == _run(engine(cuda_graphs=False), prompts, 12)
