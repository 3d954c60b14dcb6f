"""The latency gate: an artifact is promoted only if it is faster than its FP32 source.

Both models run on ONNX Runtime CPU in this process, as the serving engine
runs them (no spinning threads), on the declared serving shapes. The machine
is shared and noisy, so the measurement is built to survive that:

- Interleaved rounds: each round times the source and the candidate back to
  back at one shape (which goes first alternates), so a slow phase of the
  machine hits both alike.
- A paired statistic: per round, speedup = median(source) / median(candidate)
  over that round's runs; the shape's speedup is the median over rounds, and
  its spread the 25th-75th percentile of the round speedups.
- The rule (`decide`): the candidate is faster at a shape if the median round
  speedup exceeds `min_speedup` (1.0: strictly faster) AND the candidate won
  at least half the rounds; the gate passes if it is faster at every shape.
  A noisy tie is a failure: promotion needs evidence of a gain.

`min_speedup <= 0` measures and reports without refusing. `decide` is a pure
function of the timings, unit-tested on given numbers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from surge.engines.base import random_batch
from surge.models.hf import ModelSpec

SHAPES = ((1, 32), (8, 64))
ROUNDS = 9
RULE = "faster at every serving shape: median over interleaved rounds of the per-round speedup > {min:.2f} and won >= half the rounds"


@dataclass
class ShapeTimings:
    batch: int
    seq: int
    source_ms: list[list[float]]  # per round, that round's runs
    optimized_ms: list[list[float]]


def decide(timings: list[ShapeTimings], min_speedup: float = 1.0) -> dict:
    """The gate's verdict and the report rows, from measured (or given) timings."""
    rows, passed = [], True
    for t in timings:
        per_round = np.array([np.median(s) / np.median(o) for s, o in zip(t.source_ms, t.optimized_ms)])
        src, opt = np.concatenate(t.source_ms), np.concatenate(t.optimized_ms)
        speedup = float(np.median(per_round))
        wins = float((per_round > 1.0).mean())
        faster = bool(min_speedup <= 0 or (speedup > min_speedup and wins >= 0.5))  # <= 0: measure, never refuse
        passed &= faster
        rows.append({"batch": t.batch, "seq": t.seq,
                     "source_ms": round(float(np.median(src)), 3), "optimized_ms": round(float(np.median(opt)), 3),
                     "source_p25": round(float(np.percentile(src, 25)), 3), "source_p75": round(float(np.percentile(src, 75)), 3),
                     "optimized_p25": round(float(np.percentile(opt, 25)), 3),
                     "optimized_p75": round(float(np.percentile(opt, 75)), 3),
                     "speedup": round(speedup, 3), "speedup_p25": round(float(np.percentile(per_round, 25)), 3),
                     "speedup_p75": round(float(np.percentile(per_round, 75)), 3), "rounds_won": round(wins, 3),
                     "faster": faster})
    return {"passed": bool(passed) and bool(rows), "rule": RULE.format(min=min_speedup), "min_speedup": min_speedup,
            "rows": rows}


def parse_shapes(text: str) -> tuple[tuple[int, int], ...]:
    """'1x32,8x64' -> ((1, 32), (8, 64))."""
    from surge.errors import ConfigError

    shapes = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        try:
            b, s = part.lower().split("x")
            shapes.append((int(b), int(s)))
        except ValueError:
            raise ConfigError(f"serving shape must look like BATCHxSEQ (e.g. 8x64), not {part!r}") from None
        if shapes[-1][0] < 1 or not 2 <= shapes[-1][1] <= 512:
            raise ConfigError(f"serving shape {part!r}: batch >= 1 and 2 <= seq <= 512")
    if not shapes:
        raise ConfigError("no serving shape given")
    return tuple(shapes)


def measure(source: Path | bytes, optimized: Path | bytes, vocab: int, threads: int = 0, shapes=SHAPES,
            rounds: int = ROUNDS, budget_ms: float = 60.0, disabled_optimizers: list[str] | tuple = (),
            source_disabled: list[str] | tuple = ()) -> list[ShapeTimings]:
    """Interleaved timings; per round and model, runs until `budget_ms` is spent (at least 2 runs)."""
    from surge.optimize.validate import session

    src = session(source, threads, source_disabled, spinning=False)
    opt = session(optimized, threads, disabled_optimizers, spinning=False)
    out = []
    for batch, seq in shapes:
        b = random_batch(batch, seq, min(vocab, 30522))
        feeds = {"input_ids": b.input_ids, "attention_mask": b.attention_mask, "token_type_ids": b.token_type_ids}
        pair = [(src, _feeds(src, feeds)), (opt, _feeds(opt, feeds))]
        for sess, f in pair:  # warm-up: first-run allocations are not serving latency
            sess.run(None, f)
            sess.run(None, f)
        t = ShapeTimings(batch, seq, [], [])
        for r in range(rounds):
            order = (0, 1) if r % 2 == 0 else (1, 0)
            got: dict[int, list[float]] = {}
            for i in order:
                got[i] = _runs(*pair[i], budget_ms)
            t.source_ms.append(got[0])
            t.optimized_ms.append(got[1])
        out.append(t)
    return out


def _feeds(sess, feeds: dict) -> dict:
    names = {i.name for i in sess.get_inputs()}
    return {k: v for k, v in feeds.items() if k in names}


def _runs(sess, feeds: dict, budget_ms: float, max_runs: int = 50) -> list[float]:
    times: list[float] = []
    spent = 0.0
    while len(times) < 2 or (spent < budget_ms and len(times) < max_runs):
        start = time.perf_counter()
        sess.run(None, feeds)
        ms = (time.perf_counter() - start) * 1000
        times.append(ms)
        spent += ms
    return times


def compare_latency(source: Path | bytes, optimized: Path | bytes, spec: ModelSpec, threads: int = 0,
                    shapes=SHAPES, rounds: int = ROUNDS, disabled_optimizers: list[str] | tuple = (),
                    min_speedup: float = 1.0, budget_ms: float = 60.0) -> dict:
    timings = measure(source, optimized, spec.vocab_size, threads, shapes, rounds, budget_ms, disabled_optimizers)
    verdict = decide(timings, min_speedup)
    return {"measured": True, "engine": "onnxruntime-cpu (no spinning, as served)", "threads": threads or "all",
            "rounds": rounds, "statistic": "median; spread p25-p75", "rows": verdict["rows"],
            "gate": {"passed": verdict["passed"], "rule": verdict["rule"], "min_speedup": min_speedup}}
