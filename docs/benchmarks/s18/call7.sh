#!/usr/bin/env bash
# Session 18, device call 7 (run as one command line): the decoder engine against transformers on the final code.
export PYTHONPATH=src; timeout 140 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_decoder_cuda.py > $OUT/call7_decoder_tests.txt 2>&1; echo rc=$?; tail -2 $OUT/call7_decoder_tests.txt; grep -E "^FAILED" $OUT/call7_decoder_tests.txt | head
