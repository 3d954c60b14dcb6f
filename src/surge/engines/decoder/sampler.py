"""Sampling on the device: logit bias, penalties, guides, temperature, top-k / top-p / min-p, seeded draws,
logprobs.

Rows are sequences of one step. Greedy rows take the argmax of the (penalized)
logits. Sampled rows draw with the exponential-race trick (argmax of p / E,
E ~ Exp(1)), which needs one uniform vector per row: a row with a seed draws it
from its own generator, so its tokens do not depend on the batch it ran in.
Log-probabilities are those of the model (log-softmax of the raw logits), as
OpenAI reports them. A guided row (structured output, runtime/guided.py) keeps only
the tokens its matcher allows, after the bias and the penalties, and its matcher
takes the chosen token.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

import torch

from surge.runtime.scheduler.sequence import Sequence


@dataclass
class SampleOut:
    token: int
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None  # (token, logprob), best first
    # the chosen token's rank in the raw distribution (1: the likeliest), vLLM's Logprob.rank: Triton's
    # vLLM backend returns it, and it cannot be told from `top` when the token is not among them
    rank: int | None = None
    # with the first sampled token of a sequence that asked for them: its prompt's (token, logprob,
    # top, rank) from the second token on (the runner's prefill scores them)
    prompt: list | None = None


class GuideRejected(RuntimeError):
    """Guided rows' chosen tokens were ones their guides do not accept. The fault is those rows' own requests'
    (a guide beside allowed tokens or bad words that leave none of its tokens, a grammar past the parser's
    limits), not the engine's: `seq_ids` names them, and StepLoop.contain fails them alone, their step's other
    rows run again without it counting against them."""

    def __init__(self, message: str, seq_ids=()):
        super().__init__(message)
        self.seq_ids = frozenset(seq_ids)


class Sampler:
    """`guides`: a callable that builds the model's runtime.guided.Guides, called at the first guided
    sequence (None: a guided sequence is an error); `eos_ids`: the model's end-of-sequence tokens."""

    def __init__(self, device: torch.device, guides=None, eos_ids=()):
        self.device = device
        self.eos = tuple(eos_ids)  # kept from rows under their min_tokens (unless ignore_eos)
        self._generators: dict[int, torch.Generator] = {}
        self._shared = torch.Generator(device=device)
        self._shared.seed()
        self._guides_factory = guides
        self._guides = None
        self._matchers: dict[int, object] = {}  # seq_id -> Matcher, or the Future building it
        # seq_id -> (the output index of a seeded sequence's latest draw, its generator's state before it): a step
        # that raised after the draw is undone by rewind()
        self._drawn: dict[int, tuple[int, torch.Tensor]] = {}
        self._pool = None

    def forget(self, seq_id: int) -> None:
        self._generators.pop(seq_id, None)
        self._matchers.pop(seq_id, None)
        self._drawn.pop(seq_id, None)

    def rewind(self, seq: Sequence) -> None:
        """After a step that raised (StepLoop.contain): the sequence's seeded generator and guide's matcher put
        back where its tokens leave them (a draw, or a token consumed, for a token it never got is undone), so
        its step run again gives what the failed one would have."""
        n = len(seq.output_ids)
        drawn = self._drawn.pop(seq.seq_id, None)
        if drawn is not None and drawn[0] == n and seq.seq_id in self._generators:
            self._generators[seq.seq_id].set_state(drawn[1])
        m = self._matchers.get(seq.seq_id)
        if m is not None and not isinstance(m, Future) and m.consumed != n:
            m = self._matchers[seq.seq_id] = self._guides_ready().matcher(seq.params.guide)
            for t in seq.output_ids:
                m.consume(t)

    def _guides_ready(self):
        if self._guides is None:
            if self._guides_factory is None:
                raise ValueError("this engine has no tokenizer for guided decoding")
            self._guides = self._guides_factory()
        return self._guides

    def prepare(self, seqs: list[Sequence]) -> None:
        """Start building the matchers of guided sequences seen for the first time (their prefill steps),
        on a worker thread (llguidance releases the GIL), so that a burst of new guided requests does
        not stall the engine's step loop for every stream (a few ms each for a large schema)."""
        for seq in seqs:
            if seq.params.guide is not None and seq.seq_id not in self._matchers:
                if self._pool is None:
                    from concurrent.futures import ThreadPoolExecutor

                    self._pool = ThreadPoolExecutor(2, thread_name_prefix="surge-guides")
                self._matchers[seq.seq_id] = self._pool.submit(self._guides_ready().matcher, seq.params.guide)

    def _matcher(self, seq: Sequence):
        """The sequence's matcher (waited for if prepare() started it; built here if not). A preempted
        sequence keeps its own: recomputing its prompt and output samples nothing."""
        m = self._matchers.get(seq.seq_id)
        if m is None:
            m = self._matchers[seq.seq_id] = self._guides_ready().matcher(seq.params.guide)
        elif isinstance(m, Future):
            m = self._matchers[seq.seq_id] = m.result()
        return m

    def _generator(self, seq: Sequence) -> torch.Generator:
        g = self._generators.get(seq.seq_id)
        if g is None:
            g = self._generators[seq.seq_id] = torch.Generator(device=self.device)
            g.manual_seed(int(seq.params.seed) & 0xFFFF_FFFF_FFFF_FFFF)
        return g

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[SampleOut]:
        params = [s.params for s in seqs]
        want_logprobs = any(p.logprobs is not None for p in params)
        if all(p.greedy and not p.penalized for p in params) and not want_logprobs:
            return [SampleOut(int(t)) for t in logits.argmax(-1).tolist()]
        logits = logits.float()  # a graph's logits are in the model's dtype (a no-op when already FP32)
        raw = logits
        logits = logits.clone()
        if any(p.penalized for p in params):
            self._penalize(logits, seqs)
        tokens = torch.empty(len(seqs), dtype=torch.long, device=logits.device)
        greedy = [i for i, p in enumerate(params) if p.greedy]
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if greedy:
            idx = torch.tensor(greedy, device=logits.device)
            tokens[idx] = logits[idx].argmax(-1)
        if sampled:
            idx = torch.tensor(sampled, device=logits.device)
            probs = self._probs(logits[idx], [params[i] for i in sampled])
            noise = torch.empty_like(probs)
            unseeded = []
            for row, i in enumerate(sampled):
                if params[i].seed is not None:
                    g = self._generator(seqs[i])
                    self._drawn[seqs[i].seq_id] = (len(seqs[i].output_ids), g.get_state())
                    noise[row] = torch.rand(probs.shape[1], generator=g, device=probs.device)
                else:
                    unseeded.append(row)
            if unseeded:
                rows = torch.tensor(unseeded, device=probs.device)
                noise[rows] = torch.rand((len(unseeded), probs.shape[1]), generator=self._shared, device=probs.device)
            race = probs / (-torch.log(noise.clamp_min(1e-20)))
            tokens[idx] = race.argmax(-1)
        chosen_tokens = tokens.tolist()
        rejected = [i for i, p in enumerate(params)
                    if p.guide is not None and not self._matcher(seqs[i]).consume(chosen_tokens[i])]
        if rejected:
            # the guide allowed no token it accepts (a grammar this vocabulary cannot write, or past the parser's
            # limits, or the request's own allowed tokens or bad words leaving none): those sequences fail
            # (StepLoop.contain), as vLLM finishes them with an error, rather than ending on a token that breaks
            # their format as if they were complete; every rejected row is named, so that none fails a neighbour
            raise GuideRejected(f"the structured-output constraint rejected token {chosen_tokens[rejected[0]]}: no "
                                "token of the vocabulary continues the answer", [seqs[i].seq_id for i in rejected])
        out = [SampleOut(int(t)) for t in chosen_tokens]
        if want_logprobs:
            lp = torch.log_softmax(raw, dim=-1)
            chosen_t = lp.gather(1, tokens[:, None])
            ranks = ((lp > chosen_t).sum(-1) + 1).tolist()
            chosen = chosen_t[:, 0].tolist()
            k = max(p.logprobs or 0 for p in params)
            top_v, top_i = lp.topk(k, dim=-1) if k else (None, None)
            top_v = top_v.tolist() if k else None
            top_i = top_i.tolist() if k else None
            for i, p in enumerate(params):
                if p.logprobs is None:
                    continue
                out[i].logprob, out[i].rank = chosen[i], ranks[i]
                if p.logprobs:
                    out[i].top = list(zip(top_i[i][: p.logprobs], top_v[i][: p.logprobs]))
        return out

    def speculative(self, logits: torch.Tensor, items: list[tuple[int, Sequence, list[int]]]) -> list[list[int]]:
        """Sampled sequences of a speculative step (n-gram drafts: single tokens, no draft distribution):
        `logits` [rows, vocab] of the step; items (first row, sequence, drafts), the sequence's rows
        first_row .. first_row + len(drafts). Each row draws its token as plain sampling would at that
        position (the same filters, the same exponential race, the next uniforms of the sequence's
        generator); a draft is kept when its row drew it, and the first row that drew another token ends
        the step with that token. A draft is then kept with probability p(draft), as rejection sampling
        against a point-mass draft keeps it, and the tokens are the very ones plain sampling gives: a
        seeded sequence's answer does not depend on speculation or on the batch. A seeded generator is
        put back to where the tokens kept leave it. -> per item its new tokens."""
        if not items:
            return []
        dev = logits.device
        rows = [r for r0, _, d in items for r in range(r0, r0 + len(d) + 1)]
        params = [seq.params for _, seq, d in items for _ in range(len(d) + 1)]
        probs = self._probs(logits.index_select(0, torch.tensor(rows, device=dev)).float(), params)
        vocab = probs.shape[1]
        out, i = [], 0
        for _, seq, d in items:
            n = len(d)
            seeded = seq.params.seed is not None
            g = self._generator(seq) if seeded else self._shared
            if seeded:
                self._drawn[seq.seq_id] = (len(seq.output_ids), g.get_state())
            states, noise = [], torch.empty((n + 1, vocab), device=dev)
            for j in range(n + 1):  # one uniform vector a position, in order, as a step of plain sampling draws
                if seeded:
                    states.append(g.get_state())
                noise[j] = torch.rand(vocab, generator=g, device=dev)
            drawn = (probs[i:i + n + 1] / -torch.log(noise.clamp_min(1e-20))).argmax(-1).tolist()
            i += n + 1
            k = 0
            while k < n and drawn[k] == d[k]:
                k += 1
            if seeded and k < n:  # the draws of rows past the one that ended the step are given back
                g.set_state(states[k + 1])
            out.append(drawn[:k + 1])
        return out

    def _penalize(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        dev = logits.device
        for i, seq in enumerate(seqs):
            p = seq.params
            if p.logit_bias:
                # first, as vLLM does: the penalties below then see the biased logits
                ids, bias = p.logit_bias_arrays
                logits[i].index_add_(0, torch.from_numpy(ids).to(dev), torch.from_numpy(bias).to(dev, logits.dtype))
            if p.repetition_penalty != 1.0:
                # transformers' RepetitionPenaltyLogitsProcessor, over prompt and output
                ids = torch.tensor(sorted(set(seq.token_ids)), device=dev)
                score = logits[i, ids]
                logits[i, ids] = torch.where(score < 0, score * p.repetition_penalty, score / p.repetition_penalty)
            if (p.presence_penalty or p.frequency_penalty) and seq.output_ids:
                # OpenAI: logit -= count * frequency + (count > 0) * presence, over the output
                out = torch.tensor(seq.output_ids, device=dev)
                counts = torch.zeros(logits.shape[1], device=dev).index_add_(0, out, torch.ones_like(out, dtype=torch.float32))
                logits[i] -= counts * p.frequency_penalty + (counts > 0).float() * p.presence_penalty
            banned = []
            out_ids = seq.output_ids
            if p.min_stops and len(out_ids) < p.min_tokens:  # vLLM's min_tokens: no stop token yet
                banned += list(p.stop_token_ids) + ([] if p.ignore_eos else list(self.eos))
            if p.bad_words_ids:  # vLLM's bad_words: the token that would complete one, where it would
                always = p.bad_word_index[0]
                if len(always):  # index_fill_ on the row: an advanced-index assignment costs ~100x more on the CPU
                    logits[i].index_fill_(0, torch.from_numpy(always).to(dev), float("-inf"))
                banned += p.banned_after(out_ids)
            if banned:
                logits[i].index_fill_(0, torch.tensor(banned, device=dev, dtype=torch.long), float("-inf"))
            if p.allowed_token_ids:  # vLLM's allowed_token_ids: the others never drawn
                keep = torch.full((logits.shape[1],), float("-inf"), device=dev, dtype=logits.dtype)
                keep[torch.from_numpy(p.allowed_ids_array).to(dev)] = 0.0
                logits[i] += keep
        guided = [i for i, seq in enumerate(seqs) if seq.params.guide is not None]
        if guided:  # last: a guide's mask is a constraint, not a preference
            from surge.runtime.guided import allowed

            rows = torch.tensor(guided, device=dev)
            matchers = [self._matcher(seqs[i]) for i in guided]
            ok = allowed(self._guides.masks(matchers), logits.shape[1], dev)
            logits[rows] = logits[rows].masked_fill(~ok, float("-inf"))

    @staticmethod
    def _probs(logits: torch.Tensor, params) -> torch.Tensor:
        temps = torch.tensor([p.temperature for p in params], device=logits.device, dtype=logits.dtype)
        logits = logits / temps[:, None]
        top_k = [p.top_k for p in params]
        if any(k > 0 for k in top_k):
            v = logits.shape[1]
            ks = torch.tensor([k if 0 < k < v else v for k in top_k], device=logits.device)
            kth = logits.sort(dim=-1, descending=True).values.gather(1, (ks - 1)[:, None])
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        top_p = [p.top_p for p in params]
        if any(tp < 1.0 for tp in top_p):
            sp, si = probs.sort(dim=-1, descending=True)
            cum = sp.cumsum(-1)
            tp = torch.tensor(top_p, device=probs.device, dtype=probs.dtype)[:, None]
            drop = (cum - sp) >= tp  # tokens after the nucleus (the first is always kept)
            sp = sp.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(1, si, sp)
        min_p = [p.min_p for p in params]
        if any(mp > 0 for mp in min_p):
            mp = torch.tensor(min_p, device=probs.device, dtype=probs.dtype)[:, None]
            probs = probs.masked_fill(probs < mp * probs.max(-1, keepdim=True).values, 0.0)
        return probs / probs.sum(-1, keepdim=True)
