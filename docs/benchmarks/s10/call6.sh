# Session 10, device call 6 (nvidia-h200): the GPU tests of the decode path on the final code (attention
# launch 4 warps / 3 stages, two steps in flight, PDL, the gate/up kernel).
set +e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > $OUT/env.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src
date -u >> $OUT/env.txt
t=$(date +%s); timeout 220 python3 -m pytest -q tests/gpu/test_decode_attention_cuda.py tests/gpu/test_gate_up_cuda.py tests/gpu/test_decoder_cuda.py > $OUT/tests.txt 2>&1; echo "tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; grep -E "passed|failed|Error" $OUT/tests.txt | tail -5
