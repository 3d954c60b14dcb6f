#!/usr/bin/env bash
# Session 41, call 4: the GPU test files whose engine paths sessions 39-41 touched besides the decoder file (row
# graphs and prompts beside the launches under FP8 weights and rows, LoRA deltas, the decoder embedder), on the
# session's final engine code.
set +e
nvidia-smi --query-gpu=name --format=csv > $OUT/env.txt; date >> $OUT/env.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > /tmp/pip.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src:.
t=$(date +%s); timeout 480 python3 -m pytest -q -p no:cacheprovider -rfEs tests/gpu/test_fp8_rows_cuda.py \
  tests/gpu/test_weight_quant_cuda.py tests/gpu/test_lora_delta_cuda.py tests/gpu/test_decoder_embedder_cuda.py \
  > $OUT/tests.txt 2>&1
echo "tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; grep -E "^FAILED|^ERROR|passed|failed" $OUT/tests.txt | tail -15
