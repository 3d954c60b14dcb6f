"""gptq.feedback_factor's contract: the upper triangular U with U^T U = H^-1, computed without H^-1,
equal to the Cholesky factor of the explicit inverse that GPTQ's paper uses (float64 reference)."""

from __future__ import annotations

import numpy as np
import pytest

from surge.optimize.gptq import feedback_factor, gptq_int8


def _spd(rng, k: int, tokens: int) -> np.ndarray:
    x = rng.standard_normal((tokens, k)) @ rng.standard_normal((k, k))  # correlated, as activations are
    h = x.T @ x / tokens
    return h + 0.01 * np.mean(np.diag(h)) * np.eye(k)  # gptq_int8's dampening


@pytest.mark.parametrize("k", [1, 7, 64, 384])
def test_factor_is_the_cholesky_factor_of_the_inverse(k):
    rng = np.random.default_rng(k)
    h = _spd(rng, k, 4 * k + 10)
    u = feedback_factor(h)
    assert u.shape == (k, k) and np.array_equal(u, np.triu(u)) and (np.diag(u) > 0).all()
    inv = np.linalg.inv(h)
    ref = np.linalg.cholesky(inv).T
    assert np.allclose(u, ref, rtol=1e-9, atol=1e-12 * np.abs(ref).max())
    assert np.allclose(u.T @ u @ h, np.eye(k), atol=1e-8)
    # and it reads H: another H gives another factor
    assert not np.allclose(feedback_factor(h + np.eye(k)), u)


def test_not_positive_definite_is_an_error():
    with pytest.raises(np.linalg.LinAlgError):
        feedback_factor(np.diag([1.0, -1.0, 2.0]))


def test_gptq_codes_equal_those_of_the_explicit_inverse():
    """The rounding only reads U: with the inverse's factor the same codes come out."""
    rng = np.random.default_rng(3)
    h = _spd(rng, 300, 1500)  # three of gptq_int8's 128-row blocks
    w = rng.standard_normal((300, 40)) * 0.05
    q, scale = gptq_int8(w, h)
    # the same algorithm, written out with np.linalg.inv (the paper's form)
    wd = w.astype(np.float64).copy()
    hd = h.copy()
    hd += 0.01 * float(np.mean(np.diag(hd))) * np.eye(300)
    u = np.linalg.cholesky(np.linalg.inv(hd)).T
    ref = np.empty(w.shape, np.int8)
    s = np.maximum(np.abs(wd).max(0), 1e-12) / 127.0
    for i in range(300):
        row = np.clip(np.round(wd[i] / s), -127, 127)
        ref[i] = row
        wd[i + 1:] -= np.outer(u[i, i + 1:], (wd[i] - row * s) / u[i, i])
    assert np.array_equal(q, ref) and np.allclose(scale, s.astype(np.float32))
