"""surge/blas_threads.py: numpy's BLAS on one thread inside the block, the caller's setting restored after; GPTQ and
the task heads run inside it, with the same results."""

from __future__ import annotations

import numpy as np
import pytest

threadpoolctl = pytest.importorskip("threadpoolctl")


def _blas_threads() -> set[int]:
    return {i["num_threads"] for i in threadpoolctl.threadpool_info() if i["user_api"] == "blas"}


def test_one_thread_inside_and_the_callers_setting_after():
    from surge.blas_threads import one_blas_thread

    np.ones((64, 64)) @ np.ones((64, 64))  # numpy's BLAS loaded
    with threadpoolctl.threadpool_limits(limits=2, user_api="blas"):
        before = _blas_threads()
        with one_blas_thread():
            assert _blas_threads() == {1}
        assert _blas_threads() == before


def test_gptq_rounds_on_one_blas_thread_and_its_answer_does_not_change(monkeypatch):
    import surge.optimize.gptq as gptq

    rng = np.random.default_rng(5)
    x = rng.standard_normal((2048, 192))
    h, w = x.T @ x / len(x), rng.standard_normal((192, 96)) * 0.05
    seen = []
    real = gptq.feedback_factor

    def spy(hm):
        seen.append(_blas_threads())
        return real(hm)

    with threadpoolctl.threadpool_limits(limits=2, user_api="blas"):
        q1, s1 = gptq.gptq_int8(w, h, block=64)
        monkeypatch.setattr(gptq, "feedback_factor", spy)
        q2, s2 = gptq.gptq_int8(w, h, block=64)
    assert seen == [{1}]
    assert np.array_equal(q1, q2) and np.array_equal(s1, s2)
    # and it is GPTQ's answer: closer to W on these inputs than rounding each weight to its nearest code
    near = np.clip(np.round(w / s1), -127, 127)
    err = lambda q: float(np.mean((x @ (w - q * s1)) ** 2))  # noqa: E731
    assert err(q1) < err(near)
