#!/usr/bin/env bash
# Session 33 call 3: where n-gram speculation pays: the Qwen2-0.5B shape at 1, 4, 16 streams (128 + 128 tokens),
# surge with and without speculation in the same run (k = 3; k = 5 at one stream). Carry build/whl.
set +e
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > $OUT/env.txt; date >> $OUT/env.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > $OUT/pip.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src:.
for run in "1 3" "1 5" "4 3" "16 3"; do
  set -- $run
  t=$(date +%s); timeout 150 python3 benchmarks/generate.py --device cuda --shape qwen2-0.5b --budget 8192 --rounds 3 \
    --streams $1 --baseline none --speculative-tokens $2 > $OUT/generate_s$1_k$2.txt 2>&1
  echo "streams $1 k $2 rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
  grep "^| surge\|speculative steps\|time per output" $OUT/generate_s$1_k$2.txt >> $OUT/summary.txt
done
cat $OUT/env.txt $OUT/summary.txt
