#!/usr/bin/env bash
# The robustness checks that need a GPU, in parts; logs and results go to ${OUT:-results}. See
# docs/design.md#correctness for what each test asserts and why.
set -u
usage() {
  cat <<'HELP'
usage: tools/gpu_checks.sh [-h] [tests] [memcheck] [racecheck]

The robustness checks that need a GPU (default: all three parts, in that order). Logs and results go to
${OUT:-results}; the Python is ${PYTHON:-python3}.
  tests:      index arithmetic past 2**31 elements (triton, cutile); non-finite inputs and determinism (every
              implementation recorded, ours asserted); a device-side fault (an out-of-bounds store) under
              --isolate. Spread over WORKERS pytest-xdist workers on the one GPU (default 8 where it has 100 GB
              or more, else 1: four tests past 2**31 elements side by side need about 100 GB).
  memcheck,
  racecheck:  compute-sanitizer over every autotune candidate of triton and cutile, each launched once on the
              edge cases of tests/test_gpu_candidates.py (causal and not, GQA/MQA, ragged, Sq != Skv); prints how
              many reports name our kernels (reports on cuBLAS's kernels, which the oracle uses, are not ours).

examples:
  tools/gpu_checks.sh
  OUT=/tmp/checks WORKERS=4 tools/gpu_checks.sh tests memcheck
HELP
}
case "${1:-}" in -h|--help) usage; exit 0 ;; esac
out=${OUT:-results}
python=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(tests memcheck racecheck)
for part in "${parts[@]}"; do
  case "$part" in
    tests)
      mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
      workers=${WORKERS:-$(( ${mib:-0} >= 100000 ? 8 : 1 ))} spread=()
      [ "$workers" -gt 1 ] && spread=(-n "$workers" --dist load)
      "$python" -m pytest tests/test_gpu_limits.py tests/test_gpu_candidates.py suite/test_properties.py \
        "tests/test_faults.py::test_a_device_side_fault_costs_only_that_implementation" "${spread[@]}" \
        -q -p no:cacheprovider -rfs --benchmark-json="$out/properties.json" 2>&1 | tee "$out/gpu-checks.log" | tail -15
      ;;
    memcheck|racecheck)
      echo "== compute-sanitizer --tool $part"
      compute-sanitizer --tool "$part" --error-exitcode 9 --print-limit 20 \
        "$python" -m pytest tests/test_gpu_candidates.py -k unit -q -p no:cacheprovider 2>&1 \
        | tee "$out/sanitizer-$part.log" | grep -E "ERROR SUMMARY|RACECHECK SUMMARY|passed|failed|Error" | tail -8
      echo "compute-sanitizer exit status ${PIPESTATUS[0]}"
      # The oracle's reference matmuls run through cuBLAS, whose Hopper kernels (nvjet_*) racecheck flags;
      # what matters is what it says of ours.
      echo "reports naming our kernels (attention_fwd: Triton, fmha_fwd: cuTile):" \
        "$(grep -E "Error|Race|Hazard" "$out/sanitizer-$part.log" | grep -cE "attention_fwd|fmha_fwd")"
      ;;
    *) echo "unknown part: $part (tests, memcheck, racecheck)" >&2; usage >&2; exit 2 ;;
  esac
done
