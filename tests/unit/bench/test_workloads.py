"""Template workloads: distinct, repeatable, Zipf-skewed as asked; query logs round-trip."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from surge.bench.workloads import (HOT_K, exponent_for_top_share, generate_queries, make_workload, poisson_offsets,
                                   read_query_log, top_share, write_query_log, zipf_weights)


def test_queries_are_distinct_short_and_repeatable():
    a = generate_queries(6000, seed=3)
    assert len(a) == len(set(a)) == 6000
    assert a == generate_queries(6000, seed=3)
    assert a != generate_queries(6000, seed=4)
    words = np.array([len(q.split()) for q in a])
    # Assistant-style: mostly short, some long, none huge.
    assert 4 <= np.median(words) <= 12
    assert words.min() >= 2 and words.max() <= 40
    assert (words >= 15).mean() > 0.03
    assert all("{" not in q and "}" not in q for q in a)


def test_default_skew_puts_30_percent_on_the_500_hottest():
    w = make_workload(6000, seed=0)
    assert top_share(6000, w.zipf_s) == pytest.approx(0.30, abs=1e-6)
    n = 200_000
    counts = Counter(w.sample(n, seed=11))
    hot = set(w.queries[:HOT_K])
    share = sum(c for q, c in counts.items() if q in hot) / n
    # Binomial standard deviation at n=200k is ~0.001; allow 5 of them.
    assert abs(share - 0.30) < 0.005
    # Rank-frequency slope in log-log space is -s (fit on well-sampled ranks).
    freq = np.array([counts[q] for q in w.queries[:200]], dtype=float)
    slope = np.polyfit(np.log(np.arange(1, 201)), np.log(freq), 1)[0]
    assert slope == pytest.approx(-w.zipf_s, abs=0.08)


def test_exponent_inverts_top_share():
    for n, share in [(2000, 0.5), (6000, 0.3), (10000, 0.1)]:
        s = exponent_for_top_share(n, 500, share)
        assert top_share(n, s, 500) == pytest.approx(share, abs=1e-6)
    w = zipf_weights(100, 1.2)
    assert w.sum() == pytest.approx(1.0) and np.all(np.diff(w) < 0)
    assert w[0] / w[1] == pytest.approx(2 ** 1.2)


def test_streams_repeat_with_a_seed():
    w = make_workload(3000, zipf_s=0.9, seed=5)
    assert w.sample(500, seed=1) == w.sample(500, seed=1)
    assert w.sample(500, seed=1) != w.sample(500, seed=2)


def test_query_log_round_trip(tmp_path):
    w = make_workload(3000, seed=1)
    texts = w.sample(1000, seed=2) + ['quote " and, comma', "ünïcode ✓"]
    times = poisson_offsets(len(texts), 50.0, seed=3)
    log = read_query_log(write_query_log(tmp_path / "q.jsonl", texts, times))
    assert log.queries == texts
    np.testing.assert_allclose(log.times, times, atol=1e-6)
    # Replay sends the log in order, then starts over.
    assert [q for q, _ in zip(log.stream(), range(len(texts) + 2))] == texts + texts[:2]
    assert read_query_log(write_query_log(tmp_path / "w.txt", texts)).queries == texts
    assert (tmp_path / "w.txt").read_text().splitlines() == texts  # plain text: what the cache reads
    plain = tmp_path / "q.txt"
    plain.write_text("turn on the lights\n\nwhat time is it\n")
    assert read_query_log(plain).queries == ["turn on the lights", "what time is it"]
    assert read_query_log(plain).times is None


def test_bad_query_logs_are_refused(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"txt": "no text field"}\n')
    with pytest.raises(ValueError, match="a.jsonl:1"):
        read_query_log(tmp_path / "a.jsonl")
    (tmp_path / "b.jsonl").write_text('{"text": "x", "t": 2}\n{"text": "y", "t": 1}\n')
    with pytest.raises(ValueError, match="decrease"):
        read_query_log(tmp_path / "b.jsonl")
    (tmp_path / "c.txt").write_text("\n\n")
    with pytest.raises(ValueError, match="no queries"):
        read_query_log(tmp_path / "c.txt")
