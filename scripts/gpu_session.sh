#!/usr/bin/env bash
# The GPU evidence of the timing and serving work, in parts that each fit one device call. Source
# .gpu-env/env.sh first (and export PYTHONPATH=$PWD for the scripts). Results and logs go to ${OUT:-results};
# every step has its own time limit, so that a call returns what it measured.
#   ours:     serving correctness of our Triton kernels, then serving/varlen benchmarks of naive, sdpa, triton
#   sanitize: compute-sanitizer memcheck over the serving twins with our Triton kernels
#   timing:   eager / graph / kernel against do_bench_cudagraph on the decode and blog presets
#   correct:  the GPU correctness preset, every implementation, 4 xdist workers on the one GPU, cold tuning
#             cache then warm; wall times and the slowest tests
#   serve:    decode and blog in all three modes, then serving and varlen, every implementation
set -u
out=${OUT:-results}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
bench=(--benchmark-only -p no:cacheprovider -q --rounds 7 --round-ms 10 --warmup-rounds 2)
step() {  # step NAME SECONDS COMMAND...: run with a limit, log to $out/NAME.log, print its tail
  local name=$1 limit=$2; shift 2
  local start; start=$(date +%s)
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  echo "-- $name: exit $? after $(( $(date +%s) - start )) s"
  tail -4 "$out/$name.log"
}
for part in "$@"; do
  echo "== $part $(date +%T)"
  case "$part" in
    ours)
      step ours-correct 150 python3 -m pytest suite -k correctness -q -p no:cacheprovider --impl triton \
        --grid serving-cpu --grid varlen-cpu --grid serving --grid varlen
      step ours-bench 330 python3 -m pytest suite "${bench[@]}" --grid serving --grid varlen --timing graph \
        --timing eager --impl triton --impl sdpa --impl naive --benchmark-json="$out/serving-ours.json"
      ;;
    sanitize)
      step memcheck 200 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest suite -k correctness \
        -q -p no:cacheprovider --impl triton --grid serving-cpu --grid varlen-cpu
      grep -E "ERROR SUMMARY|passed|failed" "$out/memcheck.log" | tail -3
      ;;
    timing)
      step timing 400 python3 scripts/timing_compare.py --grid decode --grid blog --impl cutile --impl triton \
        --impl sdpa-cudnn --impl sdpa --impl flash-attn4 --out "$out/timing-compare.json"
      ;;
    correct)
      for pass in cold:380 warm:150; do
        FMHA_TUNING_CACHE=/tmp/tuning-correctness step "correct-${pass%:*}" "${pass#*:}" python3 -m pytest suite \
          -k correctness --grid gpu -q -p no:cacheprovider -n 4 --dist loadgroup --durations=40 \
          --benchmark-json="$out/correct-${pass%:*}.json"
      done
      ;;
    serve)
      step decode-blog 200 python3 -m pytest suite "${bench[@]}" --grid decode --grid blog --timing eager \
        --timing graph --timing kernel --impl naive --impl sdpa --impl sdpa-cudnn --impl triton --impl cutile \
        --impl flash-attn4 --benchmark-json="$out/decode-blog.json"
      step serving 360 python3 -m pytest suite "${bench[@]}" --grid serving --grid varlen --timing graph \
        --timing eager --benchmark-json="$out/serving.json"
      ;;
    *) echo "unknown part: $part" >&2; exit 2 ;;
  esac
done
