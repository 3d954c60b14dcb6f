#!/usr/bin/env bash
# Session 33 call 4: speculative_max_batch (default 2) on the Qwen2-0.5B shape: at 64 streams speculation is
# configured but off (surge with and without the setting should match), at 1 and 2 streams it runs. Carry build/whl.
set +e
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > $OUT/env.txt; date >> $OUT/env.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > $OUT/pip.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src:.
for streams in 64 1 2; do
  t=$(date +%s); timeout 150 python3 benchmarks/generate.py --device cuda --shape qwen2-0.5b --budget 8192 --rounds 5 \
    --streams $streams --baseline none --speculative-tokens 3 > $OUT/generate_s$streams.txt 2>&1
  echo "streams $streams rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
  grep "^| surge\|speculative steps\|time per output" $OUT/generate_s$streams.txt >> $OUT/summary.txt
done
cat $OUT/env.txt $OUT/summary.txt
