"""Structured outputs on the CPU engine (runtime/guided.py, the sampler's guided rows): greedy answers equal
transformers' `generate` held to the same constraint by llguidance's own helpers, token for token, in a
running batch with unguided neighbours, a small token budget and preemption; answers that finish match
their constraint (jsonschema, re.fullmatch, the choices); seeded draws are reproducible whatever the
batch; bad constraints are clear errors naming the field they came in."""

from __future__ import annotations

import json
import re

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("llguidance")

from surge.engines.decoder import DecoderEngine  # noqa: E402
from surge.errors import InvalidInput  # noqa: E402
from surge.runtime.guided import ANY_OBJECT, Guides, after_reasoning, guide_for  # noqa: E402
from surge.runtime.scheduler import SamplingParams, Scheduler, SchedulerConfig, Sequence  # noqa: E402
from tests.decoder_models import build_model  # noqa: E402
from tests.guided_reference import hf_guided  # noqa: E402

SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"},
                                           "size": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["color", "ok", "size"], "additionalProperties": False}
GUIDES = {
    "json": guide_for("json", SCHEMA, "response_format"),
    "regex": guide_for("regex", r"[0-9]{3}-[a-z]{2,5}", "guided_regex"),
    "choice": guide_for("choice", ["yes", "no", "maybe later"], "guided_choice"),
    "grammar": guide_for("grammar", 'start: "(" item (" " item){0,3} ")"\nitem: /[a-c]{1,4}/', "guided_grammar"),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.set_num_threads(1)
    return build_model("qwen2", tmp_path_factory.mktemp("guided") / "g", seed=3, vocab=512, all_bytes=True)


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tok(model_dir):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


def run(engine, seqs, arrivals, num_blocks):
    sched = Scheduler(SchedulerConfig(num_blocks=num_blocks, block_size=4, max_num_seqs=4, max_num_batched_tokens=16,
                                      max_model_len=256), engine.cfg.eos_token_ids)
    step, added = 0, 0
    while added < len(seqs) or sched.has_work:
        while added < len(seqs) and arrivals[added] <= step:
            sched.add(seqs[added])
            added += 1
        if sched.has_work:
            scheduled = sched.schedule()
            outs = engine.step(scheduled)
            for f in sched.update(scheduled, {k: v.token for k, v in outs.items()}):
                engine.forget(f.seq.seq_id)  # as the engine loop does: a finished sequence's matcher goes
        step += 1
    return sched


def matches(kind: str, text: str) -> bool:
    if kind == "json":
        import jsonschema

        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    if kind == "regex":
        return re.fullmatch(r"[0-9]{3}-[a-z]{2,5}", text) is not None
    if kind == "choice":
        return text in ("yes", "no", "maybe later")
    return re.fullmatch(r"\([a-c]{1,4}( [a-c]{1,4}){0,3}\)", text) is not None


def test_guided_greedy_equals_transformers_held_to_the_same_constraint(model_dir, hf, tok):
    engine = DecoderEngine(model_dir, num_blocks=40, block_size=4)
    texts = ["Give me JSON: ", "The code is", "Answer:", "A list", "Plain text follows and then more"]
    prompts = [tok.encode(t).ids for t in texts]
    kinds = list(GUIDES) + [None]
    jobs = [(k, p) for k in kinds for p in prompts[:2]] + [(None, prompts[4]), ("json", prompts[2])]
    seqs = [Sequence(i, p, SamplingParams(max_tokens=48, temperature=0.0, guide=GUIDES.get(k)))
            for i, (k, p) in enumerate(jobs)]
    sched = run(engine, seqs, [0, 0, 0, 1, 2, 3, 5, 8, 9, 9, 20, 21, 22], num_blocks=40)
    assert sched.preemptions > 0, "the KV cache is sized to force preemption"
    finished = 0
    for (kind, prompt), seq in zip(jobs, seqs):
        if kind is None:
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=48, do_sample=False, pad_token_id=0,
                               eos_token_id=engine.cfg.eos_token_ids[0])[0, len(prompt):].tolist()
        else:
            want = hf_guided(hf, model_dir, prompt, GUIDES[kind], 48)
        assert seq.output_ids == want, (kind, tok.decode(seq.output_ids), tok.decode(want))
        if kind is not None and seq.finish_reason == "stop":
            finished += 1
            assert matches(kind, tok.decode(seq.output_ids)), (kind, tok.decode(seq.output_ids))
    assert finished >= 6, "most guided answers end inside 48 tokens"


def test_seeded_guided_sampling_is_valid_and_independent_of_the_batch(model_dir, tok):
    engine = DecoderEngine(model_dir, num_blocks=200, block_size=4)
    prompt = tok.encode("Pick one:").ids

    def answers(batch_with_others: bool):
        seqs = [Sequence(i, prompt, SamplingParams(max_tokens=40, temperature=1.0, seed=100 + i,
                                                   guide=GUIDES["choice" if i % 2 else "regex"]))
                for i in range(6)]
        others = [Sequence(100 + i, tok.encode("noise " * (i + 1)).ids, SamplingParams(max_tokens=30, temperature=0.9))
                  for i in range(3)] if batch_with_others else []
        run(engine, others + seqs, [0] * (len(seqs) + len(others)), num_blocks=200)
        return [(s.params.guide[0], tok.decode(s.output_ids), s.finish_reason) for s in seqs]

    alone, mixed = answers(False), answers(True)
    assert alone == mixed
    for kind, text, finish in alone:
        assert finish == "stop" and matches(kind, text), (kind, text)
    assert len({t for k, t, _ in alone if k == "choice"}) >= 2 or len({t for k, t, _ in alone if k == "regex"}) >= 2


def test_guided_rows_keep_their_constraint_over_a_logit_bias(model_dir, tok):
    """The mask comes after the bias and the penalties: a bias toward a token the guide forbids loses."""
    engine = DecoderEngine(model_dir, num_blocks=60, block_size=4)
    x = tok.token_to_id("Z")  # a byte the regex never allows
    assert x is not None
    params = SamplingParams(max_tokens=20, temperature=0.0, guide=GUIDES["regex"], logit_bias=((x, 100.0),),
                            repetition_penalty=1.3)
    seq = Sequence(1, tok.encode("The code is").ids, params)
    run(engine, [seq], [0], num_blocks=60)
    assert x not in seq.output_ids and seq.finish_reason == "stop"
    assert matches("regex", tok.decode(seq.output_ids))
    free = Sequence(2, tok.encode("The code is").ids, SamplingParams(max_tokens=3, temperature=0.0,
                                                                       logit_bias=((x, 100.0),)))
    run(engine, [free], [0], num_blocks=60)
    assert free.output_ids == [x, x, x]  # the bias alone does win


def test_a_finished_guide_allows_only_the_end_of_sequence(model_dir, tok):
    guides = Guides((model_dir / "tokenizer.json").read_text(), 512, [2])
    m = guides.matcher(GUIDES["choice"])

    def allowed():
        words = m.mask()
        return [t for t in range(512) if (int(words[t // 32]) >> (t % 32)) & 1]

    assert 2 not in allowed() and len(allowed()) >= 2
    for t in tok.encode("yes").ids:
        assert m.consume(t)
    assert allowed() == [2]
    assert not m.consume(tok.token_to_id("x"))  # a token the guide forbids: an error state
    assert m.error and allowed() == [2]


def test_bad_constraints_are_clear_errors():
    for kind, value, why in (("json", "{not json", "not valid JSON"), ("json", [1], "must be an object"),
                             ("choice", [], "non-empty list"), ("choice", ["a", 3], "non-empty list"),
                             ("regex", "", "non-empty string"), ("tree", "x", "unknown constraint")):
        with pytest.raises(InvalidInput, match=why) as err:
            guide_for(kind, value, "guided_x")
        assert err.value.param == "guided_x"
    from tokenizers import Tokenizer

    from tests.decoder_models import train_tokenizer

    tok: Tokenizer = train_tokenizer(512, True)
    guides = Guides(tok.to_str(), 512)  # a front end's: no end-of-sequence token, checks only
    guides.check(("json", ANY_OBJECT), "response_format")
    for guide, why in ((("regex", "a(b"), "unclosed group"), (("json", '{"type": "objectx"}'), "objectx"),
                       (("grammar", "start: missing_rule"), "missing_rule")):
        with pytest.raises(InvalidInput, match=why) as err:
            guides.check(guide, "structured_outputs")
        assert err.value.param == "structured_outputs"
    with pytest.raises(ValueError, match="end-of-sequence"):
        guides.matcher(("json", ANY_OBJECT))
    # in the engine a guide that does not compile never raises: its matcher ends the answer
    broken = Guides(tok.to_str(), 512, [2]).matcher(("regex", "a(b"))
    assert "unclosed group" in broken.error and not broken.consume(5)
    words = broken.mask()
    assert [t for t in range(512) if (int(words[t // 32]) >> (t % 32)) & 1] == [2]


def test_request_fields_become_one_guide():
    from types import SimpleNamespace

    from surge.server.http.guided_fields import request_guide, tool_choice_guide

    checked = []
    service = SimpleNamespace(check_guide=lambda g, p: checked.append((g, p)))

    def req(**kw):
        fields = dict(response_format=None, guided_json=None, guided_regex=None, guided_choice=None,
                      guided_grammar=None, structured_outputs=None)
        return SimpleNamespace(**{**fields, **kw})

    assert request_guide(req(), service) is None
    assert request_guide(req(response_format={"type": "text"}), service) is None
    assert request_guide(req(response_format={"type": "json_object"}), service) == ("json", ANY_OBJECT)
    assert request_guide(req(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}),
                         service) == ("json", json.dumps(SCHEMA))
    assert request_guide(req(guided_choice=["a", "b"]), service) == ("choice", '["a", "b"]')
    assert request_guide(req(structured_outputs={"regex": "[a-z]+"}), service) == ("regex", "[a-z]+")
    assert request_guide(req(structured_outputs={"json_object": True}), service) == ("json", ANY_OBJECT)
    assert checked[-1] == (("json", ANY_OBJECT), "structured_outputs")
    for bad, param in ((req(response_format={"type": "json_schema"}), "response_format"),
                       (req(response_format={"type": "xml"}), "response_format"),
                       (req(guided_regex="a", guided_choice=["b"]), "guided_choice"),
                       (req(structured_outputs={"yaml": "x"}), "structured_outputs")):
        with pytest.raises(InvalidInput) as err:
            request_guide(bad, service)
        assert err.value.param == param
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    from tests.decoder_models import train_tokenizer

    guides = Guides(train_tokenizer(512, True).to_str(), 512, [2])
    call = '<tool_call>\n{"name": "add", "arguments": {}}\n</tool_call>'
    ids = guides.tokenizer.tokenize_str("\n".join([call] * 3))
    for parallel in (True, False):  # how much of three calls in a row the grammar takes
        m = guides.matcher(tool_choice_guide(tools, "required", parallel=parallel))
        taken = guides.tokenizer.decode_str(ids[:m._m.validate_tokens(ids)])
        assert taken == ("\n".join([call] * 3) if parallel else call), (parallel, taken)
    with pytest.raises(InvalidInput) as err:
        tool_choice_guide(tools, {"type": "function", "function": {"name": "sub"}})
    assert err.value.param == "tool_choice"
    with pytest.raises(InvalidInput) as err:
        request_guide(req(guided_json=SCHEMA), service, tool_choice_guide(tools, "required"))
    assert err.value.param == "tool_choice"


def test_masks_side_by_side_equal_each_matchers_own(model_dir, tok):
    guides = Guides((model_dir / "tokenizer.json").read_text(), 512, [2])
    matchers = [guides.matcher(g) for g in GUIDES.values()] + [guides.matcher(GUIDES["choice"])]
    for t in tok.encode("no").ids:  # one finished, one broken, the rest at their start or partway
        assert matchers[2].consume(t)
    assert not matchers[4].consume(tok.token_to_id("Z"))
    for t in tok.encode("12").ids:
        assert matchers[1].consume(t)
    together = guides.masks(matchers)
    assert together.shape == (5, 16)
    for row, m in zip(together, matchers):
        assert (row == m.mask()).all()
    assert len({row.tobytes() for row in together}) >= 4  # not one mask copied to every row


def test_matchers_are_built_beside_the_step_loop(model_dir, tok, monkeypatch):
    """A guided prompt's matcher is started on the sampler's worker thread at its prefill and waited for at
    its first sampled token, so a burst of new guided requests does not stall the engine thread; the
    answers are those of matchers built in place."""
    import threading

    built = []
    inner = Guides.matcher

    def recording(self, guide):
        built.append(threading.current_thread().name)
        return inner(self, guide)

    monkeypatch.setattr(Guides, "matcher", recording)
    engine = DecoderEngine(model_dir, num_blocks=200, block_size=4)
    prompts = [tok.encode(t).ids for t in ("Give me JSON: ", "The code is", "Pick one of these, please:")]
    seqs = [Sequence(i, p, SamplingParams(max_tokens=24, temperature=0.0, guide=g))
            for i, (p, g) in enumerate(zip(prompts, GUIDES.values()))]
    run(engine, seqs, [0, 0, 2], num_blocks=200)
    assert len(built) == 3 and all(name.startswith("surge-guides") for name in built), built
    in_place = DecoderEngine(model_dir, num_blocks=200, block_size=4)
    in_place.sampler.prepare = lambda seqs: None  # matchers then built at the first sampled token
    again = [Sequence(i, p, SamplingParams(max_tokens=24, temperature=0.0, guide=g))
             for i, (p, g) in enumerate(zip(prompts, GUIDES.values()))]
    run(in_place, again, [0, 0, 2], num_blocks=200)
    assert built[3:] == ["MainThread"] * 3
    assert [s.output_ids for s in seqs] == [s.output_ids for s in again]


def test_large_guides_are_not_kept_compiled():
    """Session 46: every checked guide was kept (256 of them), whatever its size: 256 distinct 2 MB grammars
    from clients held a gigabyte in each process. Guides over CACHED_CHARS compile each time, still
    checked (a bad one is a 400) and still answered by a matcher; only the last LARGE_KEPT are kept."""
    from surge.runtime.guided import CACHED_CHARS, LARGE_KEPT
    from tests.decoder_models import train_tokenizer

    guides = Guides(train_tokenizer(512, True).to_str(), 512, [2])
    big = [("grammar", f'start: "a" | "{k}"\n' + "// " + "x" * CACHED_CHARS + "\n") for k in range(3)]
    for g in big:
        guides.check(g, "guided_grammar")
        assert guides.matcher(g).error is None
    with pytest.raises(InvalidInput, match="guided_grammar"):
        guides.check(("grammar", "start: missing\n// " + "x" * CACHED_CHARS), "guided_grammar")
    small = ("regex", "[ab]+")
    guides.check(small, "guided_regex")
    assert guides._cached.cache_info().currsize == 1  # the small one only
    # of the large ones, only the last few (a request's is checked by its route, then where it starts)
    for g in big + [("grammar", f'start: "{k}"\n// ' + "x" * CACHED_CHARS) for k in range(2 * LARGE_KEPT)]:
        guides.check(g, "guided_grammar")
    assert len(guides._large) == LARGE_KEPT


def test_a_guide_the_vocabulary_cannot_start_is_a_clear_400_at_request_time():
    """A tokenizer with no `{` cannot write JSON: llguidance's first mask then lets a token (`"`) through that
    its parser rejects, and the answer used to end there, `"` and "stop". The check refuses it up front; a
    guide the vocabulary can write (what it begins with is in the vocabulary) still passes."""
    from tests.decoder_models import train_tokenizer

    tok = train_tokenizer(384, False)
    assert tok.token_to_id("{") is None and tok.token_to_id("%") is not None
    guides = Guides(tok.to_str(), tok.get_vocab_size())
    for guide, param in ((("json", ANY_OBJECT), "response_format"), (GUIDES["json"], "response_format"),
                         (("regex", r"\{[a-z]+\}"), "guided_regex"), (("grammar", 'start: "{" "}"'), "guided_grammar"),
                         (after_reasoning(("json", ANY_OBJECT), 1), "response_format")):
        with pytest.raises(InvalidInput, match="vocabulary") as err:
            guides.check(guide, param)
        assert err.value.param == param and param in str(err.value)
    guides.check(("regex", "%[a-z]+"), "guided_regex")
    guides.check(GUIDES["choice"], "guided_choice")
    guides.check(("regex", "x?"), "guided_regex")  # nothing to write: the empty answer matches


def test_a_token_the_guide_rejects_fails_the_sequence_instead_of_ending_it(tmp_path):
    """Past the request's check (a guide sent straight to the engine): the sampler raises on the rejected
    token (the step loop then fails that sequence alone, as vLLM finishes it with an error) rather than
    ending an answer that breaks the format as if it were complete."""
    from surge.engines.decoder.sampler import GuideRejected, Sampler
    from tests.decoder_models import train_tokenizer

    tok = train_tokenizer(384, False)
    eos = tok.token_to_id("<|im_end|>")
    sampler = Sampler(torch.device("cpu"), guides=lambda: Guides(tok.to_str(), tok.get_vocab_size(), [eos]),
                      eos_ids=[eos])
    for guide in (("json", ANY_OBJECT), ("grammar", 'start: "{" "}"')):
        seq = Sequence(1, tok.encode("The answer").ids, SamplingParams(max_tokens=8, temperature=0.0, guide=guide))
        logits = torch.randn(1, tok.get_vocab_size(), generator=torch.Generator().manual_seed(0))
        with pytest.raises(GuideRejected):
            sampler(logits, [seq])
        sampler.forget(1)


def test_a_rejected_guide_fails_its_request_alone_in_a_running_service(tmp_path):
    """End to end in GenerateService (its engine loop on a thread): a guide the vocabulary cannot write sent
    past the front end's check fails its own request with an error, never an answer finished as "stop",
    and the unguided request beside it in the batch gets its answer."""
    import asyncio

    from prometheus_client import CollectorRegistry
    from tokenizers import Tokenizer

    from surge.errors import SurgeError
    from surge.runtime.generate_service import GenerateService, GenerationConfig

    path = build_model("qwen2", tmp_path / "nobrace", seed=3)  # no `{` in its vocabulary
    engine = DecoderEngine(path, num_blocks=128, block_size=4, max_num_seqs=4, max_model_len=128)
    service = GenerateService("m", "1", path, engine, Tokenizer.from_file(str(path / "tokenizer.json")), None,
                              GenerationConfig(max_num_seqs=4, max_num_batched_tokens=256, max_model_len=128,
                                               cache_entries=0), metrics_registry=CollectorRegistry())
    service.mark_ready()
    prompt = service.encode("The answer is")

    async def main():
        try:
            return await asyncio.gather(
                service.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0, guide=("json", ANY_OBJECT))),
                service.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)),
                return_exceptions=True)
        finally:
            await service.close()

    guided, free = asyncio.run(main())  # was: '"', finish_reason "stop"
    assert isinstance(guided, SurgeError), guided
    # the request's own doing: a 400 (its guide refused by the service's check, or rejected by the sampler)
    assert guided.http_status == 400, guided
    assert not isinstance(free, BaseException) and free.finish_reason == "length" and len(free.token_ids) == 8


def test_requests_whose_guides_reject_never_fail_their_neighbours(model_dir, tok):
    """A guide rejects a token only through its own request (here allowed_token_ids that leave none of its
    choices' tokens; bad words or a parser's limits do the same): that is the sequence's fault, not the engine's.
    Three such requests used to count as three steps alone in a row that raised, BROKEN_AFTER: the engine was
    taken as broken and every request set apart beside them failed too, "generation failed (GuideRejected)".
    Now each fails alone and its neighbours get the answers they get without it."""
    import asyncio

    from prometheus_client import CollectorRegistry
    from tokenizers import Tokenizer

    from surge.errors import SurgeError
    from surge.runtime.generate_service import GenerateService, GenerationConfig
    from surge.runtime.scheduler.scheduler import BROKEN_AFTER, MAX_RETRIES

    engine = DecoderEngine(model_dir, num_blocks=512, block_size=4, max_num_seqs=8, max_model_len=256)
    service = GenerateService("m", "1", model_dir, engine, Tokenizer.from_file(str(model_dir / "tokenizer.json")),
                              None, GenerationConfig(max_num_seqs=8, max_num_batched_tokens=512, max_model_len=256,
                                                     cache_entries=0), metrics_registry=CollectorRegistry())
    service.mark_ready()
    prompts = [service.encode(t) for t in ("The answer is", "Pick one:", "A list", "Plain text follows")]
    no_choice = tok.token_to_id("Z")  # a token none of the choices begins with
    rejected = SamplingParams(max_tokens=8, temperature=0.0, guide=GUIDES["choice"], allowed_token_ids=(no_choice,))
    free = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    long = SamplingParams(max_tokens=240, temperature=0.0, ignore_eos=True)

    async def main():
        try:
            alone = [await service.generate(p, free) for p in prompts]
            long_alone = await service.generate(prompts[1], long)
            mixed = await asyncio.gather(*[service.generate(prompts[0], rejected) for _ in range(BROKEN_AFTER)],
                                         *[service.generate(p, free) for p in prompts], return_exceptions=True)
            # one at a time beside a long generation: each failed step set it apart, and past MAX_RETRIES it failed
            running = asyncio.ensure_future(service.generate(prompts[1], long))
            later = []
            for _ in range(MAX_RETRIES + 2):
                later.append((await asyncio.gather(service.generate(prompts[0], rejected), return_exceptions=True))[0])
            assert not (running.done() and running.exception() is None), "the rejected ran beside the long one"
            return alone, mixed, long_alone, (await asyncio.gather(running, return_exceptions=True))[0], later
        finally:
            await service.close()

    # neighbours of a rejected row go back to the batches as preempted sequences, never to the quarantine (where
    # each would run a step by itself: one bad request costing every neighbour a step alone)
    sched = service.scheduler
    quarantined: list[int] = []
    isolate = sched.isolate

    def watched(seq, blamed=True):
        isolate(seq, blamed)
        if seq in sched.quarantine:
            quarantined.append(seq.seq_id)
    sched.isolate = watched

    alone, mixed, long_alone, long_mixed, later = asyncio.run(main())
    assert not quarantined, quarantined
    bad, good = mixed[:BROKEN_AFTER], mixed[BROKEN_AFTER:]
    assert all(isinstance(r, SurgeError) for r in bad + later), bad + later
    assert all(r.http_status == 400 and "allowed_token_ids" in r.message for r in bad + later), bad + later
    assert not any(isinstance(r, BaseException) for r in good), good  # was: EngineError (GuideRejected) for all
    assert [r.token_ids for r in good] == [r.token_ids for r in alone]
    assert all(r.finish_reason == "length" and len(r.token_ids) == 8 for r in good)
    assert not isinstance(long_mixed, BaseException), long_mixed  # was: EngineError (GuideRejected), MAX_RETRIES
    assert long_mixed.token_ids == long_alone.token_ids and len(long_mixed.token_ids) == 240
