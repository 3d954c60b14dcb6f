#!/usr/bin/env bash
# Session 20, device call 3: the GPU tests of the kernels whose plan tables gained Llama-1B's shapes and the
# decoder engine's (a new test on two Llama-1B-shaped layers); the decode attention's launch shapes at
# Llama-1B's heads; the benchmark for the Llama-1B shape with the new plans.
set +e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > $OUT/pip.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src
( nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv; date -u; git log --oneline -1 ) > $OUT/env.txt 2>&1
t=$(date +%s); timeout 260 python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_splitk_gemm_cuda.py tests/gpu/test_tma_gemm_cuda.py \
    tests/gpu/test_gate_up_cuda.py tests/gpu/test_decoder_cuda.py -s > $OUT/gpu_tests.txt 2>&1; echo "tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 100 python3 benchmarks/gpu_decode_attention.py --shape llama-1b --json $OUT/attn_llama.json > $OUT/attn_llama.txt 2>&1; echo "attention rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 200 python3 benchmarks/generate.py --device cuda --shape llama-1b --budget 8192 --rounds 5 --compile --json $OUT/generate.json > $OUT/generate.txt 2>&1; echo "generate rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; tail -3 $OUT/gpu_tests.txt; grep "Llama-1B layers\|trained model\|passed\|failed" $OUT/gpu_tests.txt | tail -8
head -12 $OUT/attn_llama.txt | tail -9; grep "^|\|surge:\|Error\|error" $OUT/generate.txt | tail -8
