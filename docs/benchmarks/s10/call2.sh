# Session 10, device call 2 (nvidia-h200): the decode attention reading its first key tile before the wait,
# SiLU(gate) * up in one Triton kernel (kernels/gate_up.py): tests, a tuning sweep, the host's floor on this
# machine's CPU, then the engines interleaved (the gu variant with the sweep's best chain plan), decoder tests.
set +e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > $OUT/env.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src
( nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv; date -u; nproc; lscpu | grep "Model name" ) >> $OUT/env.txt 2>&1
t=$(date +%s); timeout 150 python3 -m pytest -q tests/gpu/test_decode_attention_cuda.py tests/gpu/test_gate_up_cuda.py > $OUT/tests_kernels.txt 2>&1; echo "kernel tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 240 python3 benchmarks/gpu_gate_up_tune.py --json $OUT/gate_up_tune.json > $OUT/gate_up_tune.txt 2>&1; echo "tune rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
PLAN=$(python3 -c "import json; c=json.load(open('$OUT/gate_up_tune.json'))['chain']; p=[r for r in c if r['pdl']] or c; print(','.join(str(v).lower() for v in p[0]['plan']))" 2>/dev/null || echo 32,128,4,3,false)
echo "gu plan $PLAN" >> $OUT/env.txt
t=$(date +%s); timeout 90 python3 benchmarks/generate_host.py --streams 64 --prompt 128 --output 128 --rounds 3 > $OUT/host.txt 2>&1; echo "host rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
S8=argmax+attn256+targmax+sk
t=$(date +%s); timeout 240 python3 benchmarks/generate_ab.py --rounds 7 --budget 8192 --profile --gate-up-plan $PLAN --variants $S8,$S8+fa+pdl,$S8+fa+pdl+gu,$S8+fa+gu --json $OUT/ab.json > $OUT/ab.txt 2>&1; echo "ab rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 150 python3 -m pytest -q tests/gpu/test_decoder_cuda.py -k "trained or no_bit" > $OUT/tests_decoder.txt 2>&1; echo "decoder tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; tail -2 $OUT/tests_kernels.txt; grep -B2 -A24 "^alone" $OUT/gate_up_tune.txt | cut -c1-200; tail -6 $OUT/host.txt; grep -A6 "^| variant" $OUT/ab.txt; grep -A9 "^profiled" $OUT/ab.txt | cut -c1-330; grep -E "Error|Traceback|failed" $OUT/ab.txt | head -5; tail -2 $OUT/tests_decoder.txt
