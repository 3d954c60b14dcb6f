#!/usr/bin/env bash
# Session 34 call 6: call 5's one failure (test_service_streams_multi_step_launches[True]: an FP32 engine-process
# service against the eager engine, prompt 4 a token apart at its 11th) run again twice on this session's code and
# twice on the session's starting code (build/base: `git archive bfed1e4 src tests`), then the issue's benchmark.
# Carry build/whl and build/base.
set +e
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > $OUT/env.txt; date >> $OUT/env.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > $OUT/pip.txt 2>&1
export PYTHONUNBUFFERED=1
T="tests/gpu/test_decoder_cuda.py::test_service_streams_multi_step_launches"
for k in 1 2; do
  PYTHONPATH=/tmp/site:src:. timeout 100 python3 -m pytest -q -p no:cacheprovider "$T" > $OUT/now_$k.txt 2>&1; echo "now $k rc=$?" >> $OUT/env.txt
  (cd build/base && PYTHONPATH=/tmp/site:src:. timeout 100 python3 -m pytest -q -p no:cacheprovider "$T" > $OUT/base_$k.txt 2>&1; echo "base $k rc=$?" >> $OUT/env.txt)
done
t=$(date +%s); PYTHONPATH=/tmp/site:src:. timeout 330 python3 benchmarks/generate.py --device cuda --shape qwen2-0.5b --budget 8192 --rounds 5 --compile \
  --json $OUT/generate.json > $OUT/generate.txt 2>&1
echo "generate rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; for f in $OUT/now_*.txt $OUT/base_*.txt; do echo "$f: $(tail -1 $f)"; grep -h "At index" $f; done
grep -v "^\[{" $OUT/generate.txt | tail -10
