# Session 8, device call 1 (nvidia-h200): tune split-K, its tests, an interleaved A/B, the decoder tests.
# Each part has its own time limit and log, so one failing loses none of the others.
# Run by the device tool from a copy of this worktree at <session checkout>/build/s8gemm (git-ignored), with the
# wheels the image lacks (pydantic 2.13.4, pydantic-core 2.46.4, annotated-types 0.7.0, typing-inspection 0.4.2,
# typing-extensions 4.16.0; py3.12 manylinux) in build/s8whl; both named in `carry`.
set +e
export PYTHONUNBUFFERED=1 PYTHONPATH=src
( nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
  python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())"
  date -u ) > $OUT/env.txt 2>&1
t=$(date +%s)
timeout 250 python3 benchmarks/gpu_splitk_tune.py --json $OUT/tune.json > $OUT/tune.txt 2>&1; echo "tune rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s)
timeout 110 python3 -m pytest -q -x tests/gpu/test_splitk_gemm_cuda.py > $OUT/tests_splitk.txt 2>&1; echo "tests_splitk rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s)
P=""; [ -s $OUT/tune.json ] && P="--splitk-plans $OUT/tune.json"
timeout 130 python3 benchmarks/generate_ab.py --rounds 7 --budget 8192 --variants argmax+attn256+targmax,argmax+attn256+targmax+sk $P --json $OUT/ab.json > $OUT/ab.txt 2>&1; echo "ab rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s)
timeout 100 python3 -m pytest -q tests/gpu/test_decoder_cuda.py -k "trained or argmax" > $OUT/tests_decoder.txt 2>&1; echo "tests_decoder rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; tail -25 $OUT/tune.txt; tail -3 $OUT/tests_splitk.txt; tail -8 $OUT/ab.txt; tail -3 $OUT/tests_decoder.txt
