#!/usr/bin/env bash
# For the next session with a device (not run in session 39: its device time was spent): short questions after a
# long cached system prompt, row graphs (512) against eager steps. After 2,000 cached tokens a 32-token question's
# rows attend to ~65k keys (inside the key bound: graph rows); after 8,000, ~257k (outside: eager in both).
set +e
nvidia-smi --query-gpu=name --format=csv > $OUT/env.txt; date >> $OUT/env.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > /tmp/pip.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src:.
for p in 2000 8000; do
  t=$(date +%s); timeout 150 python3 benchmarks/generate_ttft.py --device cuda --shape qwen2-0.5b --lengths 8 32 128 \
    --prefix $p --rows 512 0 --joins 8 --json $OUT/ttft_prefix$p.json > $OUT/ttft_prefix$p.txt 2>&1
  echo "ttft prefix $p rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
done
cat $OUT/env.txt; tail -8 $OUT/ttft_prefix*.txt
