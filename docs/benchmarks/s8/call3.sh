# Session 8, device call 3 (nvidia-h200): the committed plans. The two engines interleaved in one process
# (generate_ab.py, 9 rounds, profiled round, the graph replayed alone), two more before/after process pairs,
# and the split-K and decoder GPU tests on the committed table.
# Run by the device tool from a copy of this worktree at <session checkout>/build/s8gemm (git-ignored), with the
# wheels the image lacks (pydantic 2.13.4, pydantic-core 2.46.4, annotated-types 0.7.0, typing-inspection 0.4.2,
# typing-extensions 4.16.0; py3.12 manylinux) in build/s8whl; both named in `carry`.
set +e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ../s8whl/*.whl > $OUT/env.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src
( nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv; date -u ) >> $OUT/env.txt 2>&1
t=$(date +%s); timeout 150 python3 benchmarks/generate_ab.py --rounds 9 --budget 8192 --profile --variants argmax+attn256+targmax,argmax+attn256+targmax+sk --json $OUT/ab.json > $OUT/ab.txt 2>&1; echo "ab rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
G="benchmarks/generate.py --device cuda --shape qwen2-0.5b --budget 8192 --rounds 5 --baseline none"
for r in A3 C3 A4 C4; do
  case $r in C*) O="--decode-gemm cublas";; A*) O="--decode-gemm auto";; esac
  t=$(date +%s); echo "=== $r $O" >> $OUT/gen.txt
  timeout 60 python3 $G $O >> $OUT/gen.txt 2>&1; echo "gen $r rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
done
t=$(date +%s); timeout 110 python3 -m pytest -q tests/gpu/test_splitk_gemm_cuda.py tests/gpu/test_decoder_cuda.py -k "splitk or trained" > $OUT/tests.txt 2>&1; echo "tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; grep -A4 "^| variant" $OUT/ab.txt; grep -A5 "^profiled" $OUT/ab.txt; grep -E "^===|^\| surge|replayed" $OUT/gen.txt; tail -2 $OUT/tests.txt
