#!/usr/bin/env bash
# Session 28, call 1 (02:47 UTC): session 27's next_call.sh as written (carry build/whl); raw results in call1/.
exec bash docs/benchmarks/s27/next_call.sh
