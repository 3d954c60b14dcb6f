"""The decoder engine on the CPU (FP32) against transformers, token for token.

Seeded random GPT-2-, Llama- (plain and with llama3 / linear / yarn RoPE scaling), Qwen2-shaped
(GQA, q/k/v biases, tied embeddings), Qwen3-shaped (per-head q/k norms, a head size of its own)
and Granite-shaped models (multipliers folded into the weights, o and MLP biases) are built with
transformers and saved;
surge loads the directories. Sequences join and leave a running batch (more prompts than
max_num_seqs, later arrivals), long prompts are split by a small token budget, a shared prefix
hits the prefix cache, and the KV cache is small enough that sequences are preempted.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from surge.engines.decoder import DecoderEngine  # noqa: E402
from surge.runtime.scheduler import SamplingParams, Scheduler, SchedulerConfig, Sequence  # noqa: E402
from tests.decoder_models import build_model  # noqa: E402

KINDS = {
    "gpt2": ("gpt2", {}),
    "llama": ("llama", {}),
    "llama-llama3-rope": ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 32}}),
    "llama-linear-rope": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "llama-yarn-rope": ("llama", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                     "original_max_position_embeddings": 64}}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "granite": ("granite", {}),
}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # Tiny models: one intra-op thread is ~20x faster than two on a shared 2-core machine (no spinning).
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, one_thread):
    root = tmp_path_factory.mktemp("decoders")
    return {name: build_model(kind, root / name, seed=i, **extra) for i, (name, (kind, extra)) in enumerate(KINDS.items())}


@pytest.fixture(scope="module")
def hf_models(model_dirs):
    from transformers import AutoModelForCausalLM

    return {k: AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval() for k, d in model_dirs.items()}


def hf_greedy(model, prompt, n, **kw):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                         pad_token_id=0, **kw)
    return out[0, len(prompt):].tolist()


def drive(engine, sched, seqs, arrivals):
    """Run the loop; seqs[i] is added at step arrivals[i]."""
    step, added = 0, 0
    order = sorted(range(len(seqs)), key=lambda i: arrivals[i])
    while added < len(seqs) or sched.has_work:
        while added < len(seqs) and arrivals[order[added]] <= step:
            sched.add(seqs[order[added]])
            added += 1
        if sched.has_work:
            scheduled = sched.schedule()
            outs = engine.step(scheduled)
            sched.update(scheduled, {k: v.token for k, v in outs.items()})
            sched.blocks.check()
        step += 1
    return step


def prompts_for(vocab, seed):
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, vocab, (13,), generator=g).tolist()
    lens = (5, 23, 9, 41, 2, 17)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]
    prompts += [shared + [5, 6], shared + [7], shared + [8, 9, 10]]  # the last two hit the prefix cache
    return prompts


@pytest.mark.parametrize("name", list(KINDS))
def test_greedy_equals_transformers(name, model_dirs, hf_models):
    _check_greedy(DecoderEngine(model_dirs[name], num_blocks=22, block_size=4), hf_models[name])


@pytest.mark.parametrize("name", ["gpt2", "qwen2"])
@pytest.mark.parametrize("layout", ["in_out", "out_in", "auto"])
def test_each_cpu_weight_layout_equals_transformers(name, layout, model_dirs, hf_models):
    """cpu_weight_layout pinned either way, or measured: the same tokens as transformers (GPT-2's Conv1D runs
    [in, out] weights, Qwen2's nn.Linear [out, in])."""
    engine = DecoderEngine(model_dirs[name], num_blocks=22, block_size=4, cpu_weight_layout=layout)
    chosen = engine.model.cpu_layout
    assert set(chosen.values()) <= {"in_out", "out_in"} and set(chosen) == {"layers", "lm_head"}
    # auto: these test models' weights sit in the caches (under cpu_layout.MIN_BYTES), so nothing is timed
    assert chosen == {"layers": layout, "lm_head": layout} if layout != "auto" else \
        {"layers": "in_out", "lm_head": "in_out"}
    assert ("l0.qkv" in engine.model._wt) == (chosen["layers"] == "in_out")
    assert ("lm_head" in engine.model._wt) == (chosen["lm_head"] == "in_out")
    _check_greedy(engine, hf_models[name])


def run_greedy_workload(engine, n_new=18):
    """Nine greedy sequences through a 22-block cache (joins, later arrivals, preemption, prefix-cache hits):
    (scheduler, sequences, prompts) after the run."""
    sched = Scheduler(SchedulerConfig(num_blocks=22, block_size=4, max_num_seqs=4, max_num_batched_tokens=16,
                                      max_model_len=256), engine.cfg.eos_token_ids)
    prompts = prompts_for(engine.cfg.vocab_size, 7)
    seqs = [Sequence(i, p, SamplingParams(max_tokens=n_new, temperature=0.0, ignore_eos=True))
            for i, p in enumerate(prompts)]
    drive(engine, sched, seqs, [0, 0, 0, 3, 5, 9, 0, 30, 31])
    return sched, seqs, prompts


def _check_greedy(engine, hf_model):
    n_new = 18
    sched, seqs, prompts = run_greedy_workload(engine, n_new)
    for s, p in zip(seqs, prompts):
        assert s.output_ids == hf_greedy(hf_model, p, n_new), f"prompt {s.seq_id} of {len(p)} tokens"
    assert sched.preemptions > 0, "the KV cache is sized to force preemption"
    assert sched.blocks.hit_tokens >= 24, "the shared prefix must hit the prefix cache"
    assert sched.blocks.num_free == 22


@pytest.mark.parametrize("name,depth", [("gpt2", 1), ("qwen2", 1), ("qwen2", 2), ("gpt2", 3)])
def test_overlapped_steps_equal_transformers(name, depth, model_dirs, hf_models):
    """The loop that launches decode steps before reading the last ones back (their input tokens
    gathered from the previous step's output; 1 to 3 in flight) gives transformers' tokens, with
    joins, preemption, prefix-cache hits and stop tokens found `depth` steps late."""
    from surge.runtime.scheduler.overlap import StepLoop

    engine = DecoderEngine(model_dirs[name], num_blocks=24, block_size=4)
    sched = Scheduler(SchedulerConfig(num_blocks=24, block_size=4, max_num_seqs=4, max_num_batched_tokens=16,
                                      max_model_len=256), engine.cfg.eos_token_ids)
    prompts = prompts_for(engine.cfg.vocab_size, 7)
    n_new = 18
    refs = [hf_greedy(hf_models[name], p, n_new) for p in prompts]
    # every third sequence stops at the token it would produce 6th (found a step after it is launched)
    seqs = [Sequence(i, p, SamplingParams(max_tokens=n_new, temperature=0.0, ignore_eos=True,
                                          stop_token_ids=(refs[i][5],) if i % 3 == 0 else ()))
            for i, p in enumerate(prompts)]
    arrivals = [0, 0, 0, 3, 5, 9, 0, 30, 31]
    loop = StepLoop(sched, engine, depth=depth)
    step, added, order = 0, 0, sorted(range(len(seqs)), key=lambda i: arrivals[i])
    while added < len(seqs) or loop.busy:
        while added < len(seqs) and arrivals[order[added]] <= step:
            sched.add(seqs[order[added]])
            added += 1
        loop.step()
        sched.blocks.check()
        step += 1
    for s, ref in zip(seqs, refs):
        want = ref[: ref.index(ref[5]) + 1] if s.seq_id % 3 == 0 else ref
        assert s.output_ids == want, f"prompt {s.seq_id}"
    assert loop.overlapped > 10 and sched.preemptions > 0 and sched.blocks.hit_tokens > 0
    assert sched.blocks.num_free == 24


@pytest.mark.parametrize("name", ["gpt2", "qwen2", "qwen3", "granite"])
def test_logits_and_logprobs_match(name, model_dirs, hf_models):
    engine = DecoderEngine(model_dirs[name], num_blocks=64, block_size=8)
    sched = Scheduler(SchedulerConfig(num_blocks=64, block_size=8, max_num_seqs=4, max_num_batched_tokens=64,
                                      max_model_len=256), ())
    prompt = prompts_for(engine.cfg.vocab_size, 3)[3]
    seq = Sequence(1, prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=5))
    sched.add(seq)
    outs = []
    while sched.has_work:
        scheduled = sched.schedule()
        o = engine.step(scheduled)
        outs.append(o[1])
        sched.update(scheduled, {k: v.token for k, v in o.items()})
    with torch.no_grad():
        logits = hf_models[name](torch.tensor([seq.token_ids])).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    for i, o in enumerate(outs):
        row = lp[len(prompt) - 1 + i]
        assert o.token == int(row.argmax())
        assert o.logprob == pytest.approx(float(row[o.token]), abs=1e-4)
        top_v, top_i = row.topk(5)
        assert [t for t, _ in o.top] == top_i.tolist()
        assert [v for _, v in o.top] == pytest.approx(top_v.tolist(), abs=1e-4)


def _sample_alone_and_batched(engine_dir, params, prompt, others):
    outs = []
    for batch in ([prompt], [prompt, *others]):
        engine = DecoderEngine(engine_dir, num_blocks=128, block_size=4)
        sched = Scheduler(SchedulerConfig(num_blocks=128, block_size=4, max_num_seqs=8, max_num_batched_tokens=64,
                                          max_model_len=256), ())
        seqs = [Sequence(i, p, params if i == 0 else SamplingParams(max_tokens=12, temperature=1.0))
                for i, p in enumerate(batch)]
        drive(engine, sched, seqs, [0] * len(seqs))
        outs.append(seqs[0].output_ids)
    return outs


def test_seeded_sampling_is_reproducible_whatever_the_batch(model_dirs):
    d = model_dirs["llama"]
    prompts = prompts_for(384, 11)
    params = SamplingParams(max_tokens=12, temperature=1.3, top_k=50, top_p=0.9, seed=1234, ignore_eos=True)
    alone, batched = _sample_alone_and_batched(d, params, prompts[1], prompts[2:5])
    assert alone == batched
    other = SamplingParams(max_tokens=12, temperature=1.3, top_k=50, top_p=0.9, seed=99, ignore_eos=True)
    a2, _ = _sample_alone_and_batched(d, other, prompts[1], [])
    assert a2 != alone  # a different seed draws differently (12 tokens at temperature 1.3)


def test_top_k_one_is_greedy_and_penalties_follow_their_definitions(model_dirs, hf_models):
    d = model_dirs["qwen2"]
    hf = hf_models["qwen2"]
    prompt = prompts_for(384, 5)[1]
    engine = DecoderEngine(d, num_blocks=128, block_size=4)

    def run(params):
        sched = Scheduler(SchedulerConfig(num_blocks=128, block_size=4, max_num_seqs=4, max_num_batched_tokens=64,
                                          max_model_len=256), ())
        seq = Sequence(run.i, prompt, params)
        run.i += 1
        drive(engine, sched, [seq], [0])
        return seq.output_ids
    run.i = 0
    assert run(SamplingParams(max_tokens=10, top_k=1, seed=3, ignore_eos=True)) == hf_greedy(hf, prompt, 10)
    # repetition penalty: transformers' own processor, through generate
    assert run(SamplingParams(max_tokens=10, temperature=0, repetition_penalty=1.8, ignore_eos=True)) == \
        hf_greedy(hf, prompt, 10, repetition_penalty=1.8)
    # presence / frequency penalties (OpenAI's formula) with a manual greedy loop over the HF logits
    ours = run(SamplingParams(max_tokens=10, temperature=0, presence_penalty=1.5, frequency_penalty=0.7,
                              ignore_eos=True))
    toks, out = list(prompt), []
    for _ in range(10):
        with torch.no_grad():
            logits = hf(torch.tensor([toks])).logits[0, -1].double()
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.shape[0]).double() \
            if out else torch.zeros_like(logits)
        logits = logits - counts * 0.7 - (counts > 0).double() * 1.5
        t = int(logits.argmax())
        toks.append(t)
        out.append(t)
    assert ours == out


def test_top_p_and_top_k_restrict_the_draws(model_dirs, hf_models):
    from surge.engines.decoder.sampler import Sampler

    hf = hf_models["gpt2"]
    prompt = prompts_for(384, 2)[0]
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0, -1].float()
    probs = torch.softmax(logits / 0.8, -1)
    sp, si = probs.sort(descending=True)
    nucleus = set(si[: int((sp.cumsum(0) < 0.5).sum()) + 1].tolist())
    top5 = set(logits.topk(5).indices.tolist())
    sampler = Sampler(torch.device("cpu"))
    rows = 200
    seqs = [Sequence(i, prompt, SamplingParams(temperature=0.8, top_p=0.5, seed=i)) for i in range(rows)]
    got = {o.token for o in sampler(logits.repeat(rows, 1), seqs)}
    assert got <= nucleus and len(got) > 1
    seqs = [Sequence(i, prompt, SamplingParams(temperature=5.0, top_k=5, seed=i)) for i in range(rows)]
    got = {o.token for o in sampler(logits.repeat(rows, 1), seqs)}
    assert got <= top5 and len(got) >= 3


def test_unsupported_architecture_is_a_clear_error(tmp_path):
    import json

    from surge.errors import ConfigError
    from surge.models.decoder import is_decoder_dir, load_decoder_config

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["FalconForCausalLM"], "model_type": "falcon"}))
    assert is_decoder_dir(tmp_path)
    with pytest.raises(ConfigError, match="falcon.*not supported"):
        load_decoder_config(tmp_path)


def _forget_modules(monkeypatch, *names):
    """Take kernel modules out of sys.modules for this test (restored after it), so that finding them
    there afterwards means this test's code imported them, whatever ran earlier in the session."""
    import sys

    for name in names:
        monkeypatch.delitem(sys.modules, name, raising=False)


def test_decode_gemm_switch_leaves_the_cpu_path_alone(model_dirs, monkeypatch):
    """decode_gemm (the split-K GEMMs of CUDA decode steps) is validated everywhere, and on the CPU
    no mode plans a split-K GEMM or imports Triton: the CPU forward stays plain torch."""
    import sys

    _forget_modules(monkeypatch, "surge.engines.kernels.splitk_gemm", "surge.engines.kernels.gate_up")
    name = next(k for k in model_dirs if k != "gpt2")
    with pytest.raises(ValueError, match="decode_gemm"):
        DecoderEngine(model_dirs[name], num_blocks=8, block_size=4, decode_gemm="cutlass")
    for mode in ("auto", "splitk", "cublas"):
        engine = DecoderEngine(model_dirs[name], num_blocks=8, block_size=4, decode_gemm=mode)
        assert engine.model._splitk == {} and engine.model._splitk_max_m == 0 and engine.model._gate_up == {}
    assert "surge.engines.kernels.splitk_gemm" not in sys.modules
    assert "surge.engines.kernels.gate_up" not in sys.modules


def test_decode_attention_and_pdl_switches_leave_the_cpu_path_alone(model_dirs, monkeypatch):
    """decode_attention and pdl (the GPU decode step's one-kernel attention and dependent launches) are
    validated everywhere; on the CPU they select nothing and import no Triton kernel, and the greedy
    tokens are the same with every setting."""
    import sys

    _forget_modules(monkeypatch, "surge.engines.kernels.decode_attention", "surge.engines.kernels.pdl")
    name = next(k for k in model_dirs if k != "gpt2")
    with pytest.raises(ValueError, match="decode_attention"):
        DecoderEngine(model_dirs[name], num_blocks=8, block_size=4, decode_attention="flash")
    outs = []
    for attn, pdl in (("fused", True), ("split", False)):
        engine = DecoderEngine(model_dirs[name], num_blocks=64, block_size=4, decode_attention=attn, pdl=pdl)
        assert engine.model.decode_attention == "split" and engine.model.pdl is False
        sched = Scheduler(SchedulerConfig(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=16,
                                          max_model_len=256), engine.cfg.eos_token_ids)
        seqs = [Sequence(i, p, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
                for i, p in enumerate([[5, 9, 13, 2, 7], [3, 3, 8]])]
        drive(engine, sched, seqs, [0, 1])
        outs.append([s.output_ids for s in seqs])
    assert outs[0] == outs[1]
    assert "surge.engines.kernels.decode_attention" not in sys.modules
    assert "surge.engines.kernels.pdl" not in sys.modules


def test_l2_prefetch_is_checked_and_only_taken_on_a_gpu_that_has_it(model_dirs, hf_models):
    """l2_prefetch takes False, True, "mlp" or "staggered" (anything else is a clear error); on the CPU
    the option asks for nothing: no side stream, and greedy tokens still equal transformers'."""
    with pytest.raises(ValueError, match="l2_prefetch must be"):
        DecoderEngine(model_dirs["llama"], num_blocks=22, block_size=4, l2_prefetch="early")
    engine = DecoderEngine(model_dirs["llama"], num_blocks=22, block_size=4, l2_prefetch="staggered")
    assert engine.model._pf_stream is None
    sched = Scheduler(SchedulerConfig(num_blocks=22, block_size=4, max_num_seqs=4, max_num_batched_tokens=16,
                                      max_model_len=256), engine.cfg.eos_token_ids)
    prompts = prompts_for(engine.cfg.vocab_size, 11)[:3]
    seqs = [Sequence(i, p, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)) for i, p in enumerate(prompts)]
    drive(engine, sched, seqs, [0, 0, 2])
    for s, p in zip(seqs, prompts):
        assert s.output_ids == hf_greedy(hf_models["llama"], p, 6)


@pytest.mark.parametrize("name", ["gpt2", "qwen2"])
def test_prompt_logprobs_equal_transformers(name, model_dirs, hf_models):
    """OpenAI's echo with logprobs: the log-probabilities of every prompt token from the second on, and the
    top ones, as transformers' FP32 forward gives them, also when the prompt is prefilled in chunks (a
    16-token budget), its prefix is in the prefix cache (it must then be computed anyway) and the sequence
    is preempted and recomputed (each position handed out once)."""
    engine = DecoderEngine(model_dirs[name], num_blocks=22, block_size=4)
    sched = Scheduler(SchedulerConfig(num_blocks=22, block_size=4, max_num_seqs=4, max_num_batched_tokens=16,
                                      max_model_len=256), engine.cfg.eos_token_ids)
    prompts = prompts_for(engine.cfg.vocab_size, 11)
    scored = {1, 3, 4, 5, 7, 8}  # 23 and 41 tokens (chunked), 2 tokens, 17 (preempted), two with the shared prefix
    seqs = [Sequence(i, p, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                          prompt_logprobs=3 if i in scored else None))
            for i, p in enumerate(prompts)]
    got: dict[int, list] = {}
    step, order = 0, [0, 0, 0, 3, 5, 9, 0, 30, 31]
    pending = sorted(range(len(seqs)), key=lambda i: order[i])
    while pending or sched.has_work:
        while pending and order[pending[0]] <= step:
            sched.add(seqs[pending.pop(0)])
        if sched.has_work:
            scheduled = sched.schedule()
            outs = engine.step(scheduled)
            for sid, o in outs.items():
                if o.prompt is not None:
                    assert sid not in got, "a prompt's log-probabilities are handed out once"
                    got[sid] = o.prompt
            sched.update(scheduled, {k: v.token for k, v in outs.items()})
        step += 1
    hf = hf_models[name]
    for i in sorted(scored):
        p = prompts[i]
        with torch.no_grad():
            lp = torch.log_softmax(hf(torch.tensor([p])).logits[0, :-1].double(), dim=-1)
        want = lp.gather(1, torch.tensor(p[1:])[:, None])[:, 0].tolist()
        entries = got.get(i, [])
        assert [t for t, *_ in entries] == p[1:], f"prompt {i}: every token from the second, in order"
        assert [v for _, v, *_ in entries] == pytest.approx(want, abs=1e-4)
        # vLLM's rank: 1 + the tokens more likely than the prompt's own (near-ties aside, as FP32 rounds them)
        ranks = (lp > torch.tensor(want, dtype=lp.dtype)[:, None] + 1e-4).sum(-1) + 1
        near = (lp - torch.tensor(want, dtype=lp.dtype)[:, None]).abs().le(1e-4).sum(-1) - 1
        assert all(r0 <= r <= r0 + n for (*_, r), r0, n in zip(entries, ranks.tolist(), near.tolist()))
        top_v, top_i = lp.topk(3, dim=-1)
        for (_, _, top, _), ti, tv in zip(entries, top_i.tolist(), top_v.tolist()):
            assert [t for t, _ in top][0] == ti[0] and [v for _, v in top] == pytest.approx(tv, abs=1e-4)
        assert seqs[i].output_ids == hf_greedy(hf, p, 12)
    assert all(i not in got for i in range(len(seqs)) if i not in scored)
    assert sched.preemptions > 0 and sched.blocks.hit_tokens > 0
    assert any(seqs[i].preemptions for i in scored), [s.preemptions for s in seqs]


def test_min_tokens_keeps_stops_away_as_transformers_min_new_tokens(model_dirs, hf_models):
    """vLLM's min_tokens: the stop tokens (EOS unless ignored, stop_token_ids) cannot be sampled before
    that many tokens; greedy tokens equal transformers' generate with min_new_tokens and those tokens as
    its eos_token_id. Without min_tokens the same request stops at the early token."""
    d, hf = model_dirs["qwen2"], hf_models["qwen2"]
    engine = DecoderEngine(d, num_blocks=128, block_size=4)
    prompt = prompts_for(384, 5)[1]
    plain = hf_greedy(hf, prompt, 12)
    stop = plain[2]  # a token greedy decoding writes third
    seq_id = iter(range(100))

    def run(**kw):
        sched = Scheduler(SchedulerConfig(num_blocks=128, block_size=4, max_num_seqs=4, max_num_batched_tokens=64,
                                          max_model_len=256), engine.cfg.eos_token_ids)
        seq = Sequence(next(seq_id), prompt, SamplingParams(max_tokens=12, temperature=0.0, **kw))
        drive(engine, sched, [seq], [0])
        return seq.output_ids, seq.finish_reason

    out, reason = run(stop_token_ids=(stop,), ignore_eos=True)
    assert out == plain[:plain.index(stop) + 1] and reason == "stop"
    out, reason = run(stop_token_ids=(stop,), ignore_eos=True, min_tokens=7)
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=7, do_sample=False,
                       eos_token_id=[stop], pad_token_id=0)[0, len(prompt):].tolist()
    assert out == want and stop not in out[:7] and len(out) >= 7
    # EOS itself (not ignored) is kept away as well: transformers with the model's EOS and the stop token
    out, _ = run(stop_token_ids=(stop,), min_tokens=9)
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=9, do_sample=False,
                       eos_token_id=[stop, *engine.cfg.eos_token_ids], pad_token_id=0)[0, len(prompt):].tolist()
    assert out == want and len(out) >= 9
    with pytest.raises(Exception, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_bad_words_follow_vllms_definition(model_dirs, hf_models):
    """vLLM's bad_words as token sequences: a one-token word is never drawn; a longer one's last token is
    not drawn where the output ends with the rest of it. Checked against a greedy loop over transformers'
    logits applying that rule, with words that meet the answer (so both rules change it)."""
    d, hf = model_dirs["llama"], hf_models["llama"]
    engine = DecoderEngine(d, num_blocks=128, block_size=4)
    prompt = prompts_for(384, 6)[2]

    def reference(bad):
        toks, out = list(prompt), []
        for _ in range(12):
            with torch.no_grad():
                logits = hf(torch.tensor([toks])).logits[0, -1].double()
            for w in bad:
                if len(w) == 1 or (len(out) >= len(w) - 1 and tuple(out[len(out) - len(w) + 1:]) == w[:-1]):
                    logits[w[-1]] = float("-inf")
            toks.append(int(logits.argmax()))
            out.append(toks[-1])
        return out

    def ours(bad, seq_id):
        sched = Scheduler(SchedulerConfig(num_blocks=128, block_size=4, max_num_seqs=4, max_num_batched_tokens=64,
                                          max_model_len=256), ())
        seq = Sequence(seq_id, prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                                      bad_words_ids=bad))
        drive(engine, sched, [seq], [0])
        return seq.output_ids

    plain = reference(())
    one = ((plain[0],),)
    first = reference(one)
    assert first != plain and ours(one, 1) == first
    both = one + ((first[2], first[3]),)  # its last token is banned only after first[2]
    second = reference(both)
    assert second[:3] == first[:3] and second[3] != first[3]
    assert ours(both, 2) == second


def test_a_mistral_sliding_window_caps_the_context(tmp_path, caplog):
    """Mistral's sliding-window attention is not implemented: the context is capped at the window (with a
    warning), within which attention is exact, so answers are transformers' (whose window is the same)."""
    from surge.engines.decoder.runner import DecoderEngine as Engine
    from transformers import AutoModelForCausalLM

    d = build_model("mistral", tmp_path / "m", seed=9, sliding_window=32)
    with caplog.at_level("WARNING", logger="surge.generate"):
        engine = Engine(d, num_blocks=16, block_size=4, max_model_len=128)
    assert engine.max_model_len == 32 and "sliding-window" in caplog.text
    assert Engine(build_model("mistral", tmp_path / "full", seed=9), num_blocks=16, block_size=4).max_model_len == 256
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    sched = Scheduler(SchedulerConfig(num_blocks=16, block_size=4, max_num_seqs=2, max_num_batched_tokens=16,
                                      max_model_len=engine.max_model_len), engine.cfg.eos_token_ids)
    prompts = prompts_for(engine.cfg.vocab_size, 3)[:2]
    seqs = [Sequence(i, p, SamplingParams(max_tokens=32 - len(p) - 1, temperature=0.0, ignore_eos=True))
            for i, p in enumerate(prompts)]
    drive(engine, sched, seqs, [0, 0])
    for s, p in zip(seqs, prompts):
        assert s.output_ids == hf_greedy(hf, p, 32 - len(p) - 1)
