#!/usr/bin/env bash
# The GPU evidence of the timing and serving work, in parts that each fit one device call (README, "Running on
# a GPU"). Source .gpu-env/env.sh first. Results and logs go to ${OUT:-results}.
#   setup:   serving correctness of naive, sdpa and triton (the CPU twins and the full serving/varlen presets)
#   timing:  eager / graph / kernel against do_bench_cudagraph on the decode and blog presets
#   correct: the GPU correctness preset with every implementation, cold tuning cache then warm, wall times
#   serve:   the decode, serving and varlen benchmarks, every implementation, graph + eager (+ kernel on decode)
set -u
out=${OUT:-results}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
bench=(--benchmark-only -p no:cacheprovider -q --rounds 7 --round-ms 10 --warmup-rounds 2)
for part in "$@"; do
  echo "== $part $(date +%T)"
  case "$part" in
    setup)
      python3 -m pytest suite -k correctness -q -p no:cacheprovider --impl naive --impl sdpa --impl triton \
        --grid serving-cpu --grid varlen-cpu --grid serving --grid varlen 2>&1 | tail -6
      ;;
    timing)
      python3 scripts/timing_compare.py --grid decode --grid blog --impl cutile --impl triton --impl sdpa-cudnn \
        --impl sdpa --impl flash-attn4 --out "$out/timing-compare.json" 2>&1 | tee "$out/timing-compare.log" | tail -60
      ;;
    correct)
      for pass in cold warm; do
        start=$(date +%s.%N)
        FMHA_TUNING_CACHE=/tmp/tuning-correctness python3 -m pytest suite -k correctness --grid gpu -q \
          -p no:cacheprovider -n 4 --dist loadgroup --durations=15 2>&1 | tail -25
        echo "correctness $pass wall: $(echo "$(date +%s.%N) - $start" | bc) s"
      done
      ;;
    serve)
      python3 -m pytest suite "${bench[@]}" --grid decode --timing eager --timing graph --timing kernel \
        --impl naive --impl sdpa --impl sdpa-cudnn --impl sdpa-flash --impl triton --impl cutile --impl flash-attn4 \
        --benchmark-json="$out/decode.json" 2>&1 | tail -4
      python3 -m pytest suite "${bench[@]}" --grid serving --grid varlen --timing graph --timing eager \
        --benchmark-json="$out/serving.json" 2>&1 | tail -8
      ;;
    *) echo "unknown part: $part" >&2; exit 2 ;;
  esac
done
