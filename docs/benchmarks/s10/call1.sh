# Session 10, device call 1 (nvidia-h200): the one-kernel decode attention (RoPE + K/V write + attention) and
# programmatic dependent launch (PDL) of the decode step's Triton kernels. Kernel tests first, then the four
# engines interleaved in one process (generate_ab.py: rounds, a profiled round, the bucket-64 graph replayed
# alone), then the decoder GPU tests. Wheels the image lacks (pydantic 2.13.4, pydantic-core 2.46.4,
# annotated-types 0.7.0, typing-inspection 0.4.2, typing-extensions 4.16.0; py3.12 manylinux) in build/whl (carried).
set +e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > $OUT/env.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src
( nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv; date -u; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" ) >> $OUT/env.txt 2>&1
t=$(date +%s); timeout 120 python3 -m pytest -q -x tests/gpu/test_decode_attention_cuda.py > $OUT/tests_kernels.txt 2>&1; echo "kernel tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
S8=argmax+attn256+targmax+sk
t=$(date +%s); timeout 240 python3 benchmarks/generate_ab.py --rounds 7 --budget 8192 --profile --variants $S8,$S8+fa,$S8+pdl,$S8+fa+pdl --json $OUT/ab.json > $OUT/ab.txt 2>&1; echo "ab rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 200 python3 -m pytest -q tests/gpu/test_decoder_cuda.py > $OUT/tests_decoder.txt 2>&1; echo "decoder tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; tail -3 $OUT/tests_kernels.txt; grep -A6 "^| variant" $OUT/ab.txt; grep -A9 "^profiled" $OUT/ab.txt | cut -c1-400; tail -12 $OUT/ab.txt | grep -i -E "error|Traceback|failed" ; tail -3 $OUT/tests_decoder.txt
