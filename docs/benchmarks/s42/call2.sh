#!/usr/bin/env bash
# Session 42, call 2 (H100): the decoder's GPU tests and the new sampling / generation_config / logprob-bytes unit
# files on the GPU machine's torch, then the benchmark.
set +e; git log --oneline | head -1 > $OUT/env.txt; nvidia-smi --query-gpu=name --format=csv >> $OUT/env.txt; date >> $OUT/env.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > /tmp/pip.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src:.
t=$(date +%s); timeout 260 python3 -m pytest -q -s -p no:cacheprovider -rfE tests/gpu/test_decoder_cuda.py tests/unit/test_sampling_params_checks.py tests/unit/test_generation_config_eos.py tests/unit/test_generation_config_defaults.py tests/unit/test_logprob_bytes.py > $OUT/tests.txt 2>&1
echo "tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 200 python3 benchmarks/generate.py --device cuda --shape qwen2-0.5b --budget 8192 --rounds 5 --compile --json $OUT/generate.json > $OUT/generate.txt 2>&1
echo "generate rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; grep -E "^FAILED|^ERROR|passed|failed" $OUT/tests.txt | head; tail -14 $OUT/generate.txt
