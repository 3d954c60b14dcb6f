"""LoRA adapters in the decoder engine on the CPU (FP32) against transformers + peft, token for token.

Two adapters made with peft for each of seeded GPT-2-, Qwen2- and Granite-shaped models (every
projection at rank 8; q, v and down at rank 4 with rsLoRA, a per-module alpha and rank), loaded into two
slots of one engine. The same prompts run on the base model and on each adapter in one batch
(joins, chunked prefill, a prefix cache that must keep the three apart, preemption); every answer
equals peft's `generate` with that adapter, and each adapter changes the answers.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from surge.engines.decoder import DecoderEngine  # noqa: E402
from surge.errors import ConfigError  # noqa: E402
from surge.runtime.scheduler import SamplingParams, Scheduler, SchedulerConfig, Sequence  # noqa: E402
from tests.decoder_models import build_lora, build_model, load_peft  # noqa: E402
from tests.loop_driver import drive as drive_loop  # noqa: E402
from tests.unit.test_decoder_engine import one_thread  # noqa: E402,F401  (autouse: tiny models run on one thread)

KINDS = ("gpt2", "qwen2", "granite")


def _adapters(kind, base, root, seed):
    wide = build_lora(base, root / f"{kind}-wide", seed=seed, r=8, alpha=16)
    narrow_targets = ["c_attn"] if kind == "gpt2" else ["q_proj", "v_proj", "down_proj"]
    extra = {} if kind == "gpt2" else {"alpha_pattern": {"v_proj": 2.0}, "rank_pattern": {"down_proj": 2}}
    narrow = build_lora(base, root / f"{kind}-narrow", seed=seed + 1, r=4, alpha=8, targets=narrow_targets,
                        scale=10, use_rslora=True, **extra)
    return wide, narrow


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    out = {}
    for i, kind in enumerate(KINDS):
        base = build_model(kind, root / kind, seed=10 + i)
        out[kind] = (base, *_adapters(kind, base, root, seed=20 + 2 * i))
    return out


def drive(engine, sched, seqs, arrivals):
    """The synchronous step loop over `seqs`, seqs[i] arriving at step arrivals[i]."""
    from surge.runtime.scheduler.overlap import StepLoop

    order = sorted(range(len(seqs)), key=lambda i: arrivals[i])
    drive_loop(StepLoop(sched, engine, overlap=False), sched, [seqs[i] for i in order], sorted(arrivals))


def _greedy(model, prompt, n):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("kind", KINDS)
def test_adapters_equal_peft(kind, models):
    from transformers import AutoModelForCausalLM

    base, wide, narrow = models[kind]
    engine = DecoderEngine(base, num_blocks=22, block_size=4, max_loras=2, max_lora_rank=8)
    engine.load_adapter(1, wide)
    engine.load_adapter(2, narrow)
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(3, engine.cfg.vocab_size, (12,), generator=g).tolist()
    prompts = [torch.randint(3, engine.cfg.vocab_size, (n,), generator=g).tolist() for n in (5, 19, 9)]
    prompts += [shared + [5, 6], shared + [7, 8, 9]]
    n_new = 12
    seqs, want = [], []
    refs = {0: AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval(), 1: load_peft(base, wide),
            2: load_peft(base, narrow)}
    answers = {}
    for slot in (0, 1, 2):
        for p in prompts:
            seq = Sequence(len(seqs), p, SamplingParams(max_tokens=n_new, temperature=0.0, ignore_eos=True))
            seq.adapter, seq.adapter_uid = slot, 100 + slot if slot else 0
            seqs.append(seq)
            want.append(_greedy(refs[slot], p, n_new))
            answers.setdefault(slot, []).append(want[-1])
    sched = Scheduler(SchedulerConfig(num_blocks=22, block_size=4, max_num_seqs=6, max_num_batched_tokens=24,
                                      max_model_len=128), engine.cfg.eos_token_ids)
    arrivals = [0, 0, 2, 0, 9, 0, 1, 3, 4, 12, 0, 5, 6, 7, 15]
    drive(engine, sched, seqs, arrivals)
    for s, w in zip(seqs, want):
        assert s.output_ids == w, f"slot {s.adapter}, prompt of {s.num_prompt} tokens"
    # the adapters matter (else the test could not tell them apart from the base model)
    assert sum(a != b for a, b in zip(answers[0], answers[1])) >= 4
    assert sum(a != b for a, b in zip(answers[0], answers[2])) >= 3
    assert sched.blocks.hit_tokens >= 8, "the shared prefix must hit the cache within an adapter"
    assert sched.preemptions > 0, "the KV cache is sized to force preemption"


def test_prefix_cache_keeps_adapters_apart(models):
    """The same prompt under two adapters: the second must not reuse the first's KV blocks (it would
    decode from the other adapter's keys and values)."""
    base, wide, _ = models["qwen2"]
    engine = DecoderEngine(base, num_blocks=40, block_size=4, max_loras=1, max_lora_rank=8)
    engine.load_adapter(1, wide)
    prompt = list(range(3, 30))
    sched = Scheduler(SchedulerConfig(num_blocks=40, block_size=4, max_num_seqs=4, max_num_batched_tokens=64,
                                      max_model_len=128), engine.cfg.eos_token_ids)
    first = Sequence(0, prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    first.adapter, first.adapter_uid = 1, 7
    drive(engine, sched, [first], [0])
    second = Sequence(1, prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    drive(engine, sched, [second], [0])
    assert sched.blocks.hit_tokens == 0
    from transformers import AutoModelForCausalLM

    assert second.output_ids == _greedy(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval(),
                                        prompt, 6)
    third = Sequence(2, prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    third.adapter, third.adapter_uid = 1, 7
    drive(engine, sched, [third], [0])
    assert sched.blocks.hit_tokens == 24 and third.output_ids == first.output_ids


def test_a_slot_loaded_again_holds_only_the_new_adapter(models):
    """The wide adapter (every projection, rank 8), then the narrow one (q, v, down at rank 4 and 2) into the
    same slot: nothing of the first stays (the k, o, gate and up blocks and the wider rank columns)."""
    base, wide, narrow = models["qwen2"]
    engine = DecoderEngine(base, num_blocks=40, block_size=4, max_loras=1, max_lora_rank=8)
    prompt = list(range(3, 20))

    def run(slot):
        sched = Scheduler(SchedulerConfig(num_blocks=40, block_size=4, max_num_seqs=4, max_num_batched_tokens=64,
                                          max_model_len=128, prefix_caching=False), engine.cfg.eos_token_ids)
        seq = Sequence(0, prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        seq.adapter = slot
        drive(engine, sched, [seq], [0])
        return seq.output_ids

    engine.load_adapter(1, wide)
    assert run(1) == _greedy(load_peft(base, wide), prompt, 8) != run(0)
    engine.load_adapter(1, narrow)
    assert run(1) == _greedy(load_peft(base, narrow), prompt, 8)


def test_refused_adapters(models, tmp_path):
    import json

    base, wide, _ = models["qwen2"]
    engine = DecoderEngine(base, num_blocks=16, block_size=4, max_loras=1, max_lora_rank=4)
    with pytest.raises(ConfigError, match="rank 8, above max_lora_rank 4"):
        engine.load_adapter(1, wide)
    other = build_model("llama", tmp_path / "llama", seed=5, hidden_size=32, intermediate_size=64)
    foreign = build_lora(other, tmp_path / "foreign", r=4)
    with pytest.raises(ConfigError, match="another model"):
        engine.load_adapter(1, foreign)
    head = build_lora(base, tmp_path / "head", r=4, targets=["q_proj", "lm_head"])
    with pytest.raises(ConfigError, match="LM head"):
        engine.load_adapter(1, head)
    dora = tmp_path / "dora"
    dora.mkdir()
    (dora / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "use_dora": True}))
    with pytest.raises(ConfigError, match="DoRA"):
        engine.load_adapter(1, dora)
    with pytest.raises(ValueError, match="without LoRA slots"):
        DecoderEngine(base, num_blocks=16, block_size=4).load_adapter(1, wide)
