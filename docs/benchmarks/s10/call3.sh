# Session 10, device call 3 (nvidia-h200): the decode attention back to call 1's form (the first key tile read
# after the wait: reading it before cost ~1.6 us a layer, call 2), the committed defaults (one-kernel
# attention, PDL, the gate/up plan of call 2's sweep). The engines interleaved, the issue's benchmark with
# the compiled transformers baseline in the same process, and the GPU tests of the decoder path.
set +e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > $OUT/env.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src
( nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv; date -u ) >> $OUT/env.txt 2>&1
t=$(date +%s); timeout 100 python3 -m pytest -q tests/gpu/test_decode_attention_cuda.py > $OUT/tests_kernels.txt 2>&1; echo "kernel tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
S8=argmax+attn256+targmax+sk
t=$(date +%s); timeout 200 python3 benchmarks/generate_ab.py --rounds 7 --budget 8192 --profile --gate-up-plan 32,128,4,3,false --variants $S8,$S8+fa+pdl,$S8+fa+pdl+gu,$S8+fa+gu --json $OUT/ab.json > $OUT/ab.txt 2>&1; echo "ab rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 150 python3 benchmarks/generate.py --device cuda --shape qwen2-0.5b --budget 8192 --rounds 5 --compile --json $OUT/compile.json > $OUT/compile.txt 2>&1; echo "compile rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 170 python3 -m pytest -q tests/gpu/test_decoder_cuda.py tests/gpu/test_gate_up_cuda.py tests/gpu/test_splitk_gemm_cuda.py > $OUT/tests_decoder.txt 2>&1; echo "decoder tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; tail -1 $OUT/tests_kernels.txt; grep -A6 "^| variant" $OUT/ab.txt; grep -A9 "^profiled" $OUT/ab.txt | cut -c1-300; grep -E "^\||replayed" $OUT/compile.txt; grep -E "Error|Traceback|failed" $OUT/ab.txt $OUT/compile.txt | head -5; tail -2 $OUT/tests_decoder.txt
