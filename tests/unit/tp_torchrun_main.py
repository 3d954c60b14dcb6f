"""Run under torchrun (2 ranks): rank 0 builds the engine with launcher="env" and checks it against world 1."""

import sys

import numpy as np

from surge.engines.tensor_parallel import TensorParallelEngine, TPOptions, torchrun_main
from surge.engines.tp_weights import small_config
from surge.types import Encoded, TokenBatch

if __name__ == "__main__":
    cfg = small_config()
    code = torchrun_main(cfg, TPOptions(world=2, threads=1, seed=5))
    if code is not None:
        sys.exit(code)
    tp = TensorParallelEngine(world=2, threads=1, seed=5, launcher="env")
    tp.load(cfg)
    whole = TensorParallelEngine(world=1, seed=5)
    whole.load(cfg)
    rng = np.random.default_rng()
    batch = TokenBatch.pack([Encoded(rng.integers(0, cfg.vocab, n), rng.integers(0, 2, n)) for n in (5, 31, 9)])
    np.testing.assert_allclose(tp.run(batch), whole.run(batch), rtol=1e-4, atol=1e-4)
    tp.close()
    print("TORCHRUN-OK")
