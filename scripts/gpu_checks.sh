#!/usr/bin/env bash
# The robustness checks that need a GPU, in one call (see README, Contributors). Writes logs to ${OUT:-results}.
#   - index arithmetic past 2**31 elements (triton, cutile)
#   - non-finite inputs and determinism (every implementation recorded; ours asserted)
#   - a device-side fault (out-of-bounds store) under --isolate
#   - compute-sanitizer memcheck and racecheck over the 'sanitize' grid (causal and not, GQA, ragged)
set -u
out=${OUT:-results}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -m pytest tests/test_gpu_limits.py suite/test_properties.py \
  "tests/test_faults.py::test_a_device_side_fault_costs_only_that_implementation" \
  -q -p no:cacheprovider -rfs --benchmark-json="$out/properties.json" 2>&1 | tee "$out/gpu-checks.log" | tail -15
for tool in memcheck racecheck; do
  echo "== compute-sanitizer --tool $tool"
  timeout 240 compute-sanitizer --tool "$tool" --error-exitcode 9 --print-limit 20 \
    python3 -m pytest suite -k correctness --grid sanitize --impl triton --impl cutile -q -p no:cacheprovider \
    2>&1 | tee "$out/sanitizer-$tool.log" | grep -E "ERROR SUMMARY|RACECHECK SUMMARY|passed|failed|Error" | tail -8
  echo "exit status ${PIPESTATUS[0]}"
done
