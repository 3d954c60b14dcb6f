# Session 8, device call 2 (nvidia-h200): tune again (BLOCK_N 16 added, the pair timed for more plans), then end to
# end before (cuBLAS) / after (split-K, this call's plans) alternated as processes, the tests, the GEMM table and
# transformers + torch.compile once. Each part has its own time limit and log.
# Run by the device tool from a copy of this worktree at <session checkout>/build/s8gemm (git-ignored), with the
# wheels the image lacks (pydantic 2.13.4, pydantic-core 2.46.4, annotated-types 0.7.0, typing-inspection 0.4.2,
# typing-extensions 4.16.0; py3.12 manylinux) in build/s8whl; both named in `carry`.
set +e
T0=$(date +%s); left() { echo $(( $1 - ($(date +%s) - T0) )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ../s8whl/*.whl > $OUT/env.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src
( nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv; date -u ) >> $OUT/env.txt 2>&1
t=$(date +%s); timeout 100 python3 benchmarks/gpu_splitk_tune.py --json $OUT/tune.json > $OUT/tune.txt 2>&1; echo "tune rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
P=""; [ -s $OUT/tune.json ] && P="--splitk-plans $OUT/tune.json"
G="benchmarks/generate.py --device cuda --shape qwen2-0.5b --budget 8192 --rounds 5"
for r in C1 A1 C2 A2; do
  case $r in C*) O="--decode-gemm cublas";; A*) O="--decode-gemm auto $P";; esac
  t=$(date +%s); echo "=== $r $O" >> $OUT/gen.txt
  timeout 85 python3 $G --baseline none $O >> $OUT/gen.txt 2>&1; echo "gen $r rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
done
t=$(date +%s); timeout 120 python3 -m pytest -q tests/gpu/test_splitk_gemm_cuda.py tests/gpu/test_decoder_cuda.py > $OUT/tests.txt 2>&1; echo "tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 40 python3 benchmarks/gpu_decode_gemms.py $P > $OUT/gemms.txt 2>&1; echo "gemms rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout $(left 585) python3 $G --compile --decode-gemm auto $P --json $OUT/compile.json > $OUT/compile.txt 2>&1; echo "compile rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; grep -A8 "^| GEMM" $OUT/tune.txt; grep -A2 "^PLANS" $OUT/tune.txt; grep -E "^===|^\| surge|replayed" $OUT/gen.txt; tail -2 $OUT/tests.txt; grep "^|" $OUT/gemms.txt; grep -E "^\||replayed" $OUT/compile.txt
