set +e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/s8whl/*.whl > $OUT/env.txt 2>&1
export PYTHONUNBUFFERED=1
( nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv; date -u ) >> $OUT/env.txt 2>&1
G="benchmarks/generate.py --device cuda --shape qwen2-0.5b --budget 8192 --rounds 5 --baseline none"
for r in O1 N1 O2 N2 O3 N3; do
  case $r in O*) D=build/old;; N*) D=.;; esac
  t=$(date +%s); echo "=== $r $D" >> $OUT/gen.txt
  (cd $D && PYTHONPATH=/tmp/site:src timeout 60 python3 $G) >> $OUT/gen.txt 2>&1; echo "gen $r rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
done
t=$(date +%s); PYTHONPATH=/tmp/site:src timeout 110 python3 benchmarks/generate.py --device cuda --shape qwen2-0.5b --budget 8192 --rounds 5 --compile --json $OUT/compile.json > $OUT/compile.txt 2>&1; echo "compile rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); PYTHONPATH=/tmp/site:src timeout 100 python3 -m pytest -q tests/gpu/test_decoder_cuda.py tests/gpu/test_splitk_gemm_cuda.py > $OUT/tests.txt 2>&1; echo "tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; grep -E "^===|^\| surge|replayed" $OUT/gen.txt; grep -E "^\||replayed" $OUT/compile.txt; tail -2 $OUT/tests.txt
