#!/usr/bin/env bash
# The CUDA path checked, then measured, in one run (about 10 minutes on one H200):
#
#     bash docs/benchmarks/gpu_check.sh [OUT]      # from the repository root; OUT defaults to $OUT or /tmp/gpu-check
#
# 1. tests/engine/test_device.py on CUDA (every registered drafter, its tree mode and a chain: greedy output equal to
#    plain decoding in float32 and bfloat16, alone and batched; the prefix cache; the distribution tests; a
#    hybrid target). Without a GPU those tests skip with the reason and the CPU's run instead.
# 2. docs/benchmarks/gpu_check.py: plain decoding, the verify forward by rows and its row invariance, the
#    engine's own share of a step, batched decoding and the training throughput, on random weights of the default
#    target's shape; without a GPU it runs a tiny shape on the CPU and says that it did.
#
# It writes tests.log, measure.log, gpu_check.json and gpu_check.md into OUT and exits non-zero if either part
# failed. The package is used from this checkout (PYTHONPATH); a machine missing one of its dependencies needs
# them installed first (the device tool's README says how to carry wheels).
set -uo pipefail
out=${1:-${OUT:-/tmp/gpu-check}}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
python=${PYTHON:-python3}
if "$python" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    select=(-m cuda)  # the CPU's cases run in CI; a GPU's minutes go to CUDA
else
    echo "no CUDA device: the CUDA tests will skip, and the measurements run on the CPU"
    select=()
fi
"$python" -m pytest -q -rs -p no:cacheprovider "${select[@]}" tests/engine/test_device.py 2>&1 | tee "$out/tests.log"
tests=${PIPESTATUS[0]}
"$python" docs/benchmarks/gpu_check.py --out "$out" 2>&1 | tee "$out/measure.log"
measure=${PIPESTATUS[0]}
echo "tests: exit $tests; measurements: exit $measure; results in $out"
[ "$tests" -eq 0 ] && [ "$measure" -eq 0 ]
