# Session 12, device call 3 (nvidia-h200): the GPU tests of this session's code (decoder with the L2
# prefetch option, distill --device cuda), then where longer training takes the default 4-layer student:
# `surge distill`'s training on the GPU for 120 s (~the CPU default's steps x N), measured on the CPU.
set +e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > $OUT/env.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src
( nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv; date -u; python3 -c "import transformers, tokenizers; print(transformers.__version__, tokenizers.__version__)" ) >> $OUT/env.txt 2>&1
t=$(date +%s); timeout 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_distill_cuda.py tests/gpu/test_decoder_cuda.py > $OUT/tests.txt 2>&1; echo "tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 280 python3 benchmarks/distill_width.py --device cuda --threads 8 --model build/gpuwork/minilm --run 4:0:fp32:120 --out-dir $OUT/dw > $OUT/dw.txt 2>&1; echo "distill rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; tail -3 $OUT/tests.txt; grep -E "FAILED|Error" $OUT/tests.txt | head; tail -c 1500 $OUT/dw.txt
