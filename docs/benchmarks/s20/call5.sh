#!/usr/bin/env bash
# Session 20, device call 5: the one-kernel decode attention with each sequence's keys in slices (kv_splits):
# launch sweeps at Qwen2-0.5B's and Llama-1B's heads, the engine's decode step with the best slice counts
# interleaved (generate_ab), then the GPU tests of the attention kernels and the decoder engine.
set +e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > $OUT/pip.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src
( nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv; date -u ) > $OUT/env.txt 2>&1
for shape in qwen2-0.5b llama-1b; do
  t=$(date +%s); timeout 55 python3 benchmarks/gpu_decode_attention.py --shape $shape --kv-splits 1,2,4,8 --warps 2,4 \
      --stages 2,3 --json $OUT/attn_$shape.json > $OUT/attn_$shape.txt 2>&1; echo "attention $shape rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
done
B=argmax+targmax+sk+fa+pdl+gu+ta+tma
for shape in qwen2-0.5b llama-1b; do
  V=$(python3 benchmarks/pick_kv_variants.py $OUT/attn_$shape.json $B); echo "$shape variants: $V" >> $OUT/env.txt
  t=$(date +%s); timeout 95 python3 benchmarks/generate_ab.py --shape $shape --rounds 7 --attn-launch 4,3 --variants $V \
      --json $OUT/ab_$shape.json > $OUT/ab_$shape.txt 2>&1; echo "ab $shape rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
done
t=$(date +%s); timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_decode_attention_cuda.py tests/gpu/test_decoder_cuda.py -s > $OUT/gpu_tests.txt 2>&1; echo "tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; tail -2 $OUT/gpu_tests.txt; grep -E "^FAILED|^ERROR|kv_splits=3|Llama-1B layers" $OUT/gpu_tests.txt | head -12
for shape in qwen2-0.5b llama-1b; do head -8 $OUT/attn_$shape.txt | tail -6; grep "^|" $OUT/ab_$shape.txt | tail -4; done
