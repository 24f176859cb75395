#!/usr/bin/env bash
# The GPU evidence of the timing and serving work, in parts that each fit one device call. Source
# .gpu-env/env.sh first (and export PYTHONPATH=$PWD for the scripts). Results and logs go to ${OUT:-results};
# every step has its own time limit, so that a call returns what it measured.
#   ours:     serving correctness of our Triton kernels, then serving/varlen benchmarks of naive, sdpa, triton
#   cutile-serve: serving correctness of our cuTile and Triton kernels (twins and full presets), then their
#             serving and varlen benchmarks side by side (graph timing)
#   sanitize: compute-sanitizer memcheck over the serving twins with our Triton kernels
#   timing:   eager / graph / kernel against do_bench_cudagraph on the decode and blog presets
#   correct:  the GPU correctness preset, every implementation, 8 xdist workers (WORKERS) on the one GPU, cold tuning
#             cache then warm; wall times, the slowest tests and where the time goes (scripts/where_time_goes.py)
#   serve:    decode and blog in all three modes, then serving and varlen, every implementation
#   candidates: every cuTile candidate (two-launch causal forms and padded head dims included) on the edge
#             cases (CANDIDATES_SELECT: pytest -k instead of "cutile"), then the two-launch ones under memcheck
#   memcheck: compute-sanitizer memcheck over the cuTile candidates matching CANDIDATES (default '*16}*') on the
#             edge cases of tests/test_gpu_candidates.py that MEMCHECK_SELECT picks (pytest -k, default "cutile and
#             unit"; e.g. "s333x1000 and cutile": the whole set does not fit one call), within MEMCHECK_LIMIT s (200);
#             MEMCHECK_SHARDS=N splits the tests over N sanitizer processes side by side; SANITIZER_TOOL=racecheck (or
#             synccheck, initcheck) runs that tool instead
#   causal:   every causal cuTile candidate of the blog shapes, one and two launches, beside sdpa-cudnn (sweep)
#   causal-deep: the causal persistent forms (fixed share, dynamic) at latencies 2 / 4 and 3 / 6 beside one block
#             per tile, cuDNN and flash-attn4 where carried, D=128 and 64 (sweep)
#   prefill:  blog and fa3 presets, graph timing: cutile, flash-attn4, sdpa-cudnn, triton side by side (PREFILL_REST_MS:
#             --rest-ms, default auto; PREFILL_LIMIT: its seconds, default 560)
#   ladder:   the blog's optimisation ladder (cutile-1-baseline ... cutile-5-remap) on the blog preset, graph timing (after
#             prefill in the same call: one run, `scripts/publish_results.py prefill.json ladder.json DST`)
#   prefill-prime: (carry call 1) their checks for cutile, triton and sdpa-cudnn: tuning and compile caches filled
#             (session 22, a tuning bucket per power of two: about 450 s from cold)
#   models:   the models preset, every implementation that runs it (or MODELS_IMPLS, names with spaces between;
#             MODELS_ARGS: more suite options; MODELS_NAME: the JSON's and log's name, default models; MODELS_LIMIT:
#             its seconds, default 570; MODELS_REST_MS: --rest-ms, default auto),
#             graph timing and energy per call (ENERGY_MS, default 1000 ms of calls after each benchmark; 0: none), in
#             the flash-attn-4 carry's last call (with .gpu-fi and .gpu-fi-aot carried there too, FlashInfer needs no
#             JIT; without .gpu-fi-aot, fi-models in the second call compiles its modules: about 400 s; then run
#             MODELS_IMPLS="sdpa sdpa-flash sdpa-efficient flex" in a call of its own between the carry's two parts,
#             carrying neither: the first part's unpacked files stay under /tmp; H200, session 50)
#   fi-aot:   FlashInfer's checks of FI_GRIDS (default "models serving varlen"; carry .gpu-fi) compile its modules, which
#             come back as $OUT/flashinfer-aot.tar.xz: copied to .gpu-fi-aot/ here and carried beside .gpu-fi, later
#             calls load them ahead of time (scripts/flashinfer_env.sh) instead of compiling them (minutes a chain)
#   tune-out: this machine's tuning cache as $OUT/tuning-cache.tgz; unpacked here into .gpu-tune/ (git-ignored) and
#             carried, it seeds a later machine's cache (skip a cold tune, e.g. `models-prime tune-out` once, then
#             models chains with .gpu-tune carried in their first call)
#   models-prime: cuTile's candidates on the softcap edge cases; the models preset's checks of ours, flex and
#             sdpa-cudnn (compile and tuning caches filled for the models part)
#   gqa:      blog causal 4K, fp16 and bf16, MHA and GQA 32:8: cuTile's candidates, sdpa-cudnn, flash-attn4 (sweep)
#   tails:    head dims with a tail tile (cuTile): every cuTile candidate on the edge cases, the models preset's
#             D=96 and MLA cases, and a sweep of the tuner's D=96 candidates with a tail against padded
#   mla:      causal MLA (Q/K 192, V 128): the tuner's candidates (the 128-wide set, tails and padded) and the
#             256-wide set Q/K's width chose before, beside cuDNN and flash-attn4 where carried (sweep)
#   dynamic:  the dynamically scheduled persistent cuTile candidates beside the best fixed ones (sweep)
#   toolchains: tileiras 13.4 (in /tmp/ctk from an earlier call that carried .gpu) against 13.5 (carried in
#             .gpu135: bytecode 13.5 and the 16-warp candidates, impls/cutile/toolchain.py), the same sweep with
#             each in turn, on one machine: head dims TC_DIMS (default 128 64), the tuner's usual picks and the
#             16-warp candidates (at D=96 too: sweep.py's extras) beside cuDNN
#   Any part with tileiras 13.5: carry .gpu135 where a chain carries .gpu, and source scripts/tileiras135_env.sh
#   after .gpu-env/env.sh in every call of the chain (and scripts/flashinfer_env.sh after it in every call that
#   runs FlashInfer: its JIT's flags name CUDA_HOME, which tileiras135_env.sh sets).
#   tuner:    scripts/tuner_probe.py: every cuTile candidate of the tuner's space (and the persistent 128x256) timed
#             by exhaustive_search, graph and do_bench, on causal blog and models cases: does the tuner pick what the
#             suite then measures fastest?
#   groups:   scripts/tuner_probe.py on the short causal models and blog cases: the tuner's head group against
#             16 / 32 / 128 heads heaviest-first together (graph time)
#   paired:   scripts/tuner_probe.py on causal models and blog cases: the persistent 128x256 with a paired share
#             against its plain fixed share and the usual one-block-per-tile picks (graph time)
#   paired-more: the same cases' usual picks (64x128, 128x128, 256x64) as persistent paired blocks too
#   settled:  scripts/tuner_probe.py on causal models and blog cases: each candidate's graph time at burst clocks
#             against its time at its own sustained clocks (--methods settled), two-launch forms included
#   peeled:   scripts/tuner_probe.py --peeled-of: the 128x128 candidates with the causal diagonal peeled out of the loop
#             beside the same forms with the masked loop (PEELED_CASES: case ids; PEELED_GLOBS: more labels)
#   narrow:   the persistent 128x256 with the diagonal peeled at 128 keys beside its loop form (NARROW_CASES: case
#             ids), settled time, outputs checked first; narrow-check: those candidates' edge cases, also under
#             memcheck
#   noncausal: issue 15's fa3 non-causal shapes: the space's candidates beside forms it leaves out (tuner_probe.py
#             --add, settled time, outputs checked first) at the head dims NONCAUSAL_DIMS (default "64 128")
#   extras:   candidates outside the space (tuner_probe.py --add, outputs checked first) beside the space's usual picks,
#             settled time, in groups (EXTRAS: default "full-wide d256 d256-wide d64 mla"): full-wide, the
#             persistent 128x256 on non-causal D=128; d256, Gemma-2 global's 128x32, 128x128 and 16-warp 128x64;
#             d256-wide, the 128x128 forms on Gemma-2 local and global; d64, the 128x128 with the causal diagonal
#             peeled at D=64; mla, the 8-warp 128x64 peeled (session 27: only the 128x128 at D=256 won);
#             deferred (not in the default list), the space's forms with P V deferred (Variant.defer_pv) beside the
#             same forms without, on MLA, Llama-3-8B 4 x 4K and Gemma-2 global 1 x 32K (session 52); d64-narrow
#             (not in the default list either), the two-warpgroup 128x64 at D=64 beside the 16-warp 256x64: one block
#             a tile at L2,4 and L3,6, persistent, and causal also paired, peeled and deferred (session 53: 10-20%
#             behind the 256x64 on GPT-2 1 x 32K and fa3's D=64 rows, causal or not, though the compiler overlaps its
#             loop by itself); deferred-paired, the persistent paired 128x128 peeled with the deferral at L2,4 beside
#             the space's peeled forms on blog 2K / 4K and the 4 x 4K GQA cases (session 53: 2-6% behind one block a
#             peeled tile with the deferral, which led all four); clusters (not in the default list), 256x128 blocks
#             of two CTAs with K/V multicast on fa3's D=128 non-causal and blog's causal 2K / 4K (session 62: 7-10%
#             behind the space)
#   narrow-window: the persistent 128x256 with a window's far edge peeled beside the space's peeled forms on
#             Mistral-7B's windowed 1 x 32K (session 47: paired 561 settled TFLOPS against 552, fixed share 525)
#   window:   the windowed cuTile candidates on the edge cases, then settled times on Mistral / Gemma-2 local 1 x 32K
#   tuner-ab: the causal cases of TUNER_GRIDS (default "models blog"), cutile only, tuned from cold by each dense
#             tuner of TUNERS (default "exhaustive settled", FMHA_TUNER) into a cache of its own (/tmp/fmha/tuning-T),
#             then benchmarked (graph timing): which tuner's picks the suite measures faster (the first tuner
#             compiles: about 350 s for models and blog; the next ones reuse CUDA_TILE_CACHE_DIR's cubins)
#   tall:     head dim 64: 256-row cuTile blocks beside the tuner's picks and cuDNN (sweep)
#   d64causal: the persistent 128x256 causal candidate at D<=64: edge cases, memcheck, fa3/GPT-2 benchmarks
#   decode-probe: scripts/serving_probe.py on the 256-sequence serving cases: every cuTile decode candidate and
#             Triton's tuner space (graph of 20 calls)
#   decode-wide: the same probe on the long uniform cases: Triton's wide space beside FlashInfer in one process
#             (carry .gpu-fi; no cuTile)
#   plans:    scripts/serving_probe.py --triton plans on the serving cases where ours trailed or missed 85% of HBM
#             (PLANS_CASES: case ids): the fastest aimed and fitted split plans beside FlashInfer and the tuner's
#             pick, alternating (PLANS_MODE=plans-wide: over more tiles; PLANS_MODE=deep: the fastest of the
#             tuner's space beside the fastest K/V double-buffered config; PLANS_ARGS: more probe options, such as
#             "--deep-tile 128,4,7"; carry .gpu-fi; no cuTile)
#   profile:  Nsight Compute (clocks not locked) of one call each of the tuner's picks beside the peers PROFILE_PEERS
#             (default "flash-attn4 sdpa-cudnn"; flash-attn-4 where an earlier call of the machine unpacked it) on fa3
#             D=64 and D=128 full 4K and blog causal 2K (scripts/sweep.py --profile); details as CSV in $out/profile.tgz
#   clocks:   scripts/clock_probe.py: per-round times and SM clocks over 2 s of sustained work after a rest
#   settle:   the equal-length varlen batch and its dense twin, cutile / sdpa-cudnn / triton, graph timing, twice
#             with --settle-ms 0 and twice with the default (benchmarks timed at sustained clocks)
#   rest:     the models preset's 4 x 4K cases after its 1 x 32K ones and alone, without and with --rest-ms (an idle
#             pause before each benchmark): is the order of a run what moved a case (session 36's Mistral caveat)?
#             REST_IMPLS, REST_MS; REST_GRID and REST_ALONE (pytest -k of the cases timed alone) for another preset
#   fp8:      an fp8 KV cache: the serving twins' fp8 cases and the serving-fp8 preset checked (tuned) with our kernels
#             and sdpa (FP8_IMPLS), then, where .gpu-fi is carried, FlashInfer's checks of the same (its JIT)
#   fp8-bench: the serving-fp8 preset (bf16 and fp8 caches side by side), graph timing, FP8_IMPLS and flashinfer:
#             $out/serving-fp8-MODEL.json, one step a model (FP8_LIMIT seconds each, default 285)
#   fp8-dots: bf16 queries over an fp8 cache with the dots in fp16 (F16_DOT): the query rows of any magnitude
#             (Triton, every cuTile decode form) and the fp8 twins checked, then scripts/serving_probe.py --fp8-dots
#             on the serving-fp8 preset's fp8 cases (FP8_DOTS_CASES: case ids instead): bf16 dots against fp16
#   fp8-words: the Triton decode over fp8 with its values read as words (V_WORDS) against bytes: the tests (memcheck
#             too), the fp8 twins, then scripts/serving_probe.py --triton-switch V_WORDS on serving-fp8's fp8 cases
#   prefetch: the Triton decode's split steps under PDL with and without the first chunk's prefetch (PREFETCH): the
#             GPU test on every tile (head dims 64, 96, 128), then its padded head dim (96) under compute-sanitizer memcheck
#   ab:       implementations in alternating runs on one machine, so that a gap of 1% can be told from the machine's
#             drift: AB_PASSES (default 3) passes of AB_IMPLS (default "triton flashinfer"; FlashInfer needs .gpu-fi and
#             scripts/flashinfer_env.sh) over the AB_GRID cases (default serving) that AB_SELECT picks (pytest -k;
#             default: the serving cases of issue 12(b) where FlashInfer led on the H200, and 8B 1 x 128K), in
#             AB_TIMING (default graph), $out/ab-IMPL-PASS.json each, within AB_LIMIT seconds in all (default 470); then
#             scripts/ab_summary.py --ours FIRST-IMPL prints each case's figure per run and ours / best other per pass
#   wide:     batch x heads past 65535 (one grid axis's cap; heads and sequences now have an axis each): every
#             candidate of ours on the wide cases of tests/test_gpu_candidates.py, our tuned Triton serving entries,
#             and the refusal past 65535 sequences (WIDE_LIMIT seconds, default 300)
#   pdl:      the Triton decode with and without programmatic dependent launch (config PDL): its tests, then
#             scripts/serving_probe.py --triton-switch PDL beside PDL_PEERS (default flashinfer; flash-attn4 in the
#             flash-attn-4 carry's last call) on PDL_CASES (default: the serving cases of 12(b) a peer led in session 43)
#   varlen-probe: every cuTile serving candidate on the twins and the uneven packed batches, then
#             scripts/serving_probe.py --varlen-only (VARLEN_PROBE_ARGS: more, e.g. --varlen-persistent)
#   varlen-peel: the varlen candidates that peel the causal diagonal: checked (with the windows they peel) and under
#             memcheck, then each beside its masked loop (serving_probe.py --varlen-peel) on varlen and models-serving
#   varlen-memcheck: each cuTile varlen candidate on the uneven packed batches under compute-sanitizer memcheck,
#             one process a candidate, without PyTorch's caching allocator, with each output store of VARLEN_STORES
#             (default "plain tma"), all at once; VARLEN_PROBE_ARGS=--varlen-stores has varlen-probe time both
#   node:     (several GPUs) issue 14's evidence, PER_GPU workers a GPU (default: the cores / GPUs), as two parts
#             that each fit one call, back to back on one machine: node-correct (the correctness preset cold over all
#             GPUs and over one; heartbeats time a stopped pass) and node-bench (the same warm, blog's checks to tune
#             its shapes, the fleet check of blog, blog on one GPU and sharded over all); NODE_PASSES picks passes,
#             NODE_PASS_S caps each correctness pass's seconds.
#   dense-decode: (session 61) the decode preset through our dense entries, which hand decode steps to the split-KV
#             decode (impls._serving.decode_route): its checks primed over 16 workers and tuned in one process, then
#             timed (graph) beside DD_IMPLS (default "cutile triton sdpa sdpa-cudnn sdpa-flash sdpa-efficient naive") into
#             $out/DD_NAME.json (default dense-decode) within DD_BENCH_LIMIT s (280; flex compiles once a case).
#             FMHA_DENSE_DECODE=0 times our dense kernels there instead.
#   dense-decode-checks: the gpu and sanitize grids' decode steps through cuTile and Triton, then the sanitize grid's
#             under compute-sanitizer memcheck
# The side-by-side serving run with every implementation, in the three calls of the flash-attn-4 carry (caches
# under /tmp/fmha live as long as the machine; FlashInfer needs `source scripts/flashinfer_env.sh`):
#   serve-prime: (call 1) serving correctness of the implementations without a carried package, 16 workers (8 under
#             100 GB) that share the GPU, so that our tuners run their fixed configs (impls/_tuning.py): fills the
#             compile caches; then ours again in one process, tuning on an idle GPU into the tuning cache (PRIME_LIMIT
#             and PRIME_TUNE_LIMIT: the two steps' seconds, default 300 and 260). models-serving from a cache without
#             its classes does not fit one call: on an H100 (session 68) the prime reached 109 of its checks in
#             300 s, and our kernels' cold tune 31 of their 36 in three calls (about 1,230 s); serve-tune goes on
#   serve-tune: our kernels' checks of SERVE_GRIDS alone, tuning into the cache (a chain's first call, without
#             serve-prime's compile of every candidate)
#   serve-flashinfer: (call 2) FlashInfer's serving correctness within FI_CORRECT_LIMIT s (330): its JIT compiles the
#             kernels (minutes), or, with .gpu-fi-aot carried (fi-aot), loads them ahead of time (10 s on an H100, session
#             29). Without .gpu-fi-aot the models-serving modules took longer than that on an H200 (session 51: 9 of 18
#             checks in 330 s, the other 9 in 236 s of a second serve-flashinfer call, carrying .gpu-fa4b, before
#             serve-all), so that chain takes four calls. Without .gpu-fi-aot carried, what its JIT compiled comes back
#             as $OUT/flashinfer-aot.tar.xz (as fi-aot's)
#   flex-paged: flex's paged decode checks alone (FLEX_PAGED_LIMIT s, 300), to learn its compile cost per case
#   flex-probe: scripts/flex_paged_probe.py (FLEX_PROBE_ARGS, FLEX_PROBE_LIMIT s, 300): flex's paged forms in alternation
#   serve-all: (call 3) serving and varlen benchmarks, every implementation (SERVE_IMPLS, space-separated, to pick:
#             flex's paged entry, new in session 57, compiles once per uniform decode case, a cost not yet measured),
#             graph timing, since session 65 with --cold-l2 (SERVE_COLD=0: without): a server's step reads each layer's
#             K/V once, after every other layer's went through the L2, and timed back to back a step under 2x the L2
#             found its K/V there (serve-cold: the 70B slice's 64 x 512 from 1.18 of the best peer warm to 0.99 cold)
#   serve-cold: (session 65) the decode steps of SERVE_GRIDS whose K/V fit in twice the L2 cache, timed (graph) the way
#             serve-all times them, each call finding the K/V the call before it left in L2, then with --cold-l2 (a
#             rotation over copies of the inputs), as a server's step finds them (each layer's K/V read once a step),
#             into $out/serve-warm.json and $out/serve-cold.json; SERVE_IMPLS (default triton flashinfer
#             flash-attn4 flex: the leaders of those steps). serve-cold-prime: their checks alone (compiles: flex's, a
#             case each), for the first call of the flash-attn-4 carry
set -u
out=${OUT:-results}
# pytest-xdist 3.8 ignores xdist_group (--dist loadgroup) under pytest 9, which the image has: a carried .whl/ with
# pytest 8.4.2 (`pip download --no-deps -d .whl pytest==8.4.2`, git-ignored) takes its place when present.
if compgen -G ".whl/pytest-8*.whl" >/dev/null && [ ! -d /tmp/pytest8/_pytest ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/pytest8 .whl/pytest-8*.whl
fi
[ -d /tmp/pytest8/_pytest ] && export PYTHONPATH=/tmp/pytest8${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$out"
# A warm machine on which an earlier call of the chain unpacked tileiras 13.5 (scripts/tileiras135_env.sh) and that
# has no other tileiras on PATH: take 13.5 rather than fail every cuTile compile (session 60's serve-all call, which
# did not source it, failed all 46 cuTile benchmarks). Where 13.4 is there too (toolchains) nothing changes. It moves
# CUDA_HOME, which FlashInfer's JIT flags name, so FlashInfer's settings follow where a call set them up (a call that
# sourced flashinfer_env.sh alone lost 42 of FlashInfer's 46 serving checks to its JIT until they did).
if ! command -v tileiras >/dev/null && [ -x /tmp/ctk135/bin/tileiras ]; then
  source scripts/tileiras135_env.sh
  if [ -n "${FLASHINFER_NVCC:-}" ]; then source scripts/flashinfer_env.sh; fi
fi
export PYTHONUNBUFFERED=1
export FMHA_TUNING_CACHE=${FMHA_TUNING_CACHE:-/tmp/fmha/tuning} CUDA_TILE_CACHE_DIR=${CUDA_TILE_CACHE_DIR:-/tmp/fmha/cutile} \
  TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/fmha/triton} TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/fmha/inductor}
# A tuning cache carried in .gpu-tune/ (git-ignored; the tune-out part brings one back) seeds a fresh machine's, so
# that a chain skips its cold tune (the models preset's: about 8 minutes on an H100). Its entries are keyed on the GPU
# model, the library versions and the kernels' sources (impls/_tuning.py), so a stale one is never read. A machine's
# own files win: the seed fills only what is missing. TUNE_SEED="cutile" (families, space-separated) seeds those
# alone: the others tune on this machine, whose instance may favour other picks (session 66: Triton's picks carried
# from another H200 trailed FlashInfer by 0.4-1.2% on two 1 GB steps where picks tuned on the machine were level).
seed=()
for file in .gpu-tune/*.json; do
  [ -f "$file" ] || continue
  { [ -z "${TUNE_SEED+set}" ] || [[ " $TUNE_SEED " == *" $(basename "$file" .json) "* ]]; } && seed+=("$file")
done
if [ ${#seed[@]} -gt 0 ]; then
  mkdir -p "$FMHA_TUNING_CACHE" && cp -n "${seed[@]}" "$FMHA_TUNING_CACHE"/
  echo "tuning cache seeded from .gpu-tune: $(printf '%s\n' "${seed[@]}" | xargs -n1 basename | tr '\n' ' ')"
  python3 scripts/rekey_tuning.py .gpu-tune || true  # how many entries this code's digests find (0: a stale carry)
fi
# The serve-* parts run SERVE_GRIDS (default the serving and varlen presets) after their CPU twins SERVE_TWINS, and
# serve-all writes $out/SERVE_NAME.json (default serving-all): SERVE_GRIDS=models-serving
# SERVE_TWINS=models-serving-cpu SERVE_NAME=models-serving runs the models' serving steps the same way.
read -ra serve_grids <<< "${SERVE_GRIDS:-serving varlen}"
read -ra serve_twins <<< "${SERVE_TWINS:-serving-cpu varlen-cpu}"
full=()
for g in "${serve_grids[@]}"; do full+=(--grid "$g"); done
serving=()
for g in "${serve_twins[@]}"; do serving+=(--grid "$g"); done
serving+=("${full[@]}")
bench=(--benchmark-only -p no:cacheprovider -q --rounds 7 --round-ms 10 --warmup-rounds 2)
# our kernels' checks of the serving grids in one process on an idle GPU: they tune into the tuning cache
tune=(python3 -m pytest suite -k correctness -q -p no:cacheprovider -rf --impl cutile --impl triton "${full[@]}"
      --durations=20)
step() {  # step NAME SECONDS COMMAND...: run with a limit, log to $out/NAME.log, print its tail; its exit status
  local name=$1 limit=$2 rc; shift 2
  local start; start=$(date +%s)
  # SIGINT at the limit (SIGKILL 30 s later): pytest stops as on Ctrl-C and still prints its summary and
  # --durations, so a step cut short says what its tests took (session 59: a tune stopped at its limit did not)
  timeout -s INT -k 30 "$limit" "$@" > "$out/$name.log" 2>&1
  rc=$?
  echo "-- $name: exit $rc after $(( $(date +%s) - start )) s"
  tail -4 "$out/$name.log"
  return $rc
}
impl_options() {  # impl_options "NAME ...": the array impls=(--impl NAME ...), names (globs unexpanded) split at spaces
  local names name
  read -ra names <<< "$1"
  impls=(); for name in "${names[@]}"; do impls+=(--impl "$name"); done
}
probe_cases() {  # probe_cases NAME "CASE ..." PATTERN COMMAND...: COMMAND --case CASE on each case, a step each
  # (NAME-1, NAME-2, ...), then the lines of their logs that match PATTERN (grep -E)
  local name=$1 cases=$2 pattern=$3 n=0 c; shift 3
  for c in $cases; do
    n=$((n + 1))
    step "$name-$n" 300 "$@" --case "$c"
  done
  cat "$out/$name"-*.log | grep -E "$pattern"
}
fp8_cases() {  # the serving-fp8 preset's fp8-cache case ids, space-separated
  python3 -c "from suite.cases import preset; print(' '.join(c.id for c in preset('serving-fp8') if c.kv_dtype))"
}
behind_cases() {  # the serving cases with 64 or more sequences where a peer led ours in session 43
  local d=paged-bf16
  echo "llama3-8b-$d-h32:8-q1-kv8192-uniform-p16-d128-b64 llama3-8b-$d-h32:8-q1-kv8192-uniform-p16-d128-b256" \
    "llama3-70b-tp8-$d-h8:1-q1-kv8192-uniform-p16-d128-b256 llama3-70b-tp8-$d-h8:1-q1-kv8192-uniform-p64-d128-b64" \
    "llama3-70b-tp8-$d-h8:1-q1-kv512-uniform-p16-d128-b64"
}
# a pytest -k expression of the decode steps of the presets named in argv[2:] whose K/V fit in twice this GPU's L2
# cache, each case id followed by argv[1] ("-graph": their graph-timed benchmarks; "]": their checks) (serve-cold)
fits_in_l2='import sys, torch
from suite.cases import preset
from suite.metrics import kv_bytes
l2, end = torch.cuda.get_device_properties(0).L2_cache_size, sys.argv[1]
print(" or ".join(f"{c.id}{end}" for g in sys.argv[2:] for c in preset(g) if c.op == "paged" and kv_bytes(c) <= 2 * l2))'
cold_impls="triton flashinfer flash-attn4 flex"  # serve-cold(-prime)'s default SERVE_IMPLS: the leaders of those steps
fi_aot() {  # FlashInfer's modules of this machine (compiled here, or carried) as ahead-of-time artifacts,
  # $out/flashinfer-aot.tar.xz: NAME/NAME.so each, for .gpu-fi-aot/ (scripts/flashinfer_env.sh)
  local aot=/tmp/fi-aot so name
  mkdir -p $aot
  for so in /tmp/fmha/flashinfer/.cache/flashinfer/*/*/cached_ops/*/*.so /tmp/fisite/flashinfer/data/aot/*/*.so; do
    [ -f "$so" ] || continue
    name=$(basename "$so" .so)
    mkdir -p "$aot/$name" && cp -u "$so" "$aot/$name/"
  done
  tar -cf - -C $aot . | xz -6 -T0 > "$out/flashinfer-aot.tar.xz"
  echo "fi-aot: $(ls $aot | wc -l) modules, $(du -h "$out/flashinfer-aot.tar.xz" | cut -f1)"
}
bundle_logs() {  # bundle_logs NAME: $out/NAME-*.log as one $out/NAME-logs.tgz (the device returns 8 files at most:
  # session 58 lost a run's JSON behind eight memcheck logs)
  tar -czf "$out/$1-logs.tgz" -C "$out" $(cd "$out" && ls "$1"-*.log) && rm -f "$out/$1"-*.log
}
tuner_picks='"check": false|picks'  # tuner_probe.py's failed checks and each case's picks
memcheck_candidates() {  # memcheck_candidates GLOB SECONDS [SELECT]: the cuTile candidates whose label matches GLOB
  # on the edge cases of tests/test_gpu_candidates.py (pytest -k SELECT) under compute-sanitizer's SANITIZER_TOOL
  # (memcheck); MEMCHECK_SHARDS=N: N sanitizer processes side by side, shard i on every N-th test from the i-th
  # (logs TOOL.log, or TOOL-i.log)
  local shards=${MEMCHECK_SHARDS:-1} tool=${SANITIZER_TOOL:-memcheck} shard ids
  local sanitize=(compute-sanitizer --tool "$tool" --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider -rf)
  if [ "$shards" -le 1 ]; then
    FMHA_CANDIDATES=$1 step "$tool" "$2" "${sanitize[@]}" tests/test_gpu_candidates.py -k "${3:-cutile and unit}"
    grep -E "SUMMARY|passed|failed" "$out/$tool.log" | tail -3
    return
  fi
  python3 -m pytest tests/test_gpu_candidates.py -k "${3:-cutile and unit}" --collect-only -q -p no:cacheprovider \
    | grep "::" > "$out/$tool.ids"
  for shard in $(seq 0 $(( shards - 1 ))); do
    mapfile -t ids < <(awk -v n="$shards" -v i="$shard" '(NR - 1) % n == i' "$out/$tool.ids")
    [ ${#ids[@]} -gt 0 ] && FMHA_CANDIDATES=$1 step "$tool-$shard" "$2" "${sanitize[@]}" "${ids[@]}" &
  done
  wait
  grep -HE "SUMMARY|passed|failed|skipped" "$out/$tool"-*.log
  bundle_logs "$tool"
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
    cutile-serve)
      step serve-correct 240 python3 -m pytest suite -k correctness -q -p no:cacheprovider -rf --impl cutile \
        --impl triton --grid serving-cpu --grid varlen-cpu --grid serving --grid varlen
      step serve-bench 330 python3 -m pytest suite "${bench[@]}" --grid serving --grid varlen --timing graph \
        --impl cutile --impl triton --benchmark-json="$out/serving-ours.json"
      ;;
    serve-prime)
      # 16 workers share an H200's 141 GB; on an 80 GB H100 some cases' inputs did not fit beside the others (session 29).
      # Sharing the GPU they tune nothing; --compile-candidates has them compile every shape class's candidates that the
      # tuning cache lacks, so that the one tuning process after them times compiled kernels (impls._tuning)
      mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
      step prime "${PRIME_LIMIT:-300}" python3 -m pytest suite -k correctness -q -p no:cacheprovider -rf --impl cutile \
        --impl triton --impl flex --impl sdpa --impl naive "${serving[@]}" \
        -n "${PRIME_WORKERS:-$(( ${mib:-0} > 100000 ? 16 : 8 ))}" --dist load --compile-candidates
      # a tune cut short by its limit goes on in serve-flashinfer (the tuning cache lives in /tmp/fmha)
      step tune "${PRIME_TUNE_LIMIT:-260}" "${tune[@]}" || { [ $? = 124 ] && touch /tmp/fmha/tune-unfinished; }
      ;;
    flex-paged)  # flex's paged entry (session 57) alone, before it joins serve-all: its checks on the serving grids
      # (a length inside a page is refused at once), with the slowest prepares (each case compiles) listed
      step flex-paged "${FLEX_PAGED_LIMIT:-300}" python3 -m pytest suite -k "correctness and paged" -q \
        -p no:cacheprovider -rfs --impl flex "${full[@]}" --durations=12
      ;;
    flex-probe)  # flex's paged forms side by side (scripts/flex_paged_probe.py; FLEX_PROBE_ARGS: its options, e.g.
      # "--peer flashinfer" after sourcing scripts/flashinfer_env.sh), outputs checked
      read -r -a probe_args <<< "${FLEX_PROBE_ARGS:-}"
      step flex-probe "${FLEX_PROBE_LIMIT:-300}" python3 scripts/flex_paged_probe.py "${probe_args[@]}"
      grep -h '"variant"' "$out/flex-probe.log"
      ;;
    serve-tune)  # our kernels' checks of SERVE_GRIDS alone, tuning into the cache (a chain's first call)
      step tune "${SERVE_TUNE_LIMIT:-300}" "${tune[@]}"
      ;;
    serve-flashinfer)
      step fi-correct "${FI_CORRECT_LIMIT:-330}" python3 -m pytest suite -k correctness -q -p no:cacheprovider -rf \
        --impl flashinfer "${full[@]}" --durations=8
      # modules its JIT compiled here come back for .gpu-fi-aot/, so that a chain on a later machine loads them
      [ -f .gpu-fi-aot/flashinfer-aot.tar.xz ] || fi_aot
      if [ -f /tmp/fmha/tune-unfinished ]; then
        step tune-rest 240 "${tune[@]}" && rm -f /tmp/fmha/tune-unfinished
      fi
      ;;
    serve-all)
      read -r -a serve_impls <<< "${SERVE_IMPLS:-cutile triton flash-attn4 flashinfer sdpa flex naive}"
      cold=(); [ "${SERVE_COLD:-1}" = 0 ] || cold=(--cold-l2)
      step serve-all 540 python3 -m pytest suite "${bench[@]}" "${full[@]}" --timing graph "${cold[@]}" \
        "${serve_impls[@]/#/--impl=}" --benchmark-json="$out/${SERVE_NAME:-serving-all}.json"
      ;;
    serve-cold-prime)
      read -r -a serve_impls <<< "${SERVE_IMPLS:-$cold_impls}"
      fits=$(python3 -c "$fits_in_l2" "]" "${serve_grids[@]}")
      step serve-cold-prime 280 python3 -m pytest suite -k "correctness and ($fits)" -q -p no:cacheprovider -rf \
        "${full[@]}" "${serve_impls[@]/#/--impl=}" --durations=5
      ;;
    serve-cold)
      read -r -a serve_impls <<< "${SERVE_IMPLS:-$cold_impls}"
      fits=$(python3 -c "$fits_in_l2" "-graph" "${serve_grids[@]}")
      step serve-warm 280 python3 -m pytest suite "${bench[@]}" "${full[@]}" --timing graph -k "$fits" \
        "${serve_impls[@]/#/--impl=}" --benchmark-json="$out/serve-warm.json"
      step serve-cold 280 python3 -m pytest suite "${bench[@]}" "${full[@]}" --timing graph -k "$fits" --cold-l2 \
        "${serve_impls[@]/#/--impl=}" --benchmark-json="$out/serve-cold.json"
      ;;
    dense-decode)
      read -r -a dd_impls <<< "${DD_IMPLS:-cutile triton sdpa sdpa-cudnn sdpa-flash sdpa-efficient naive}"
      dd_ours=(python3 -m pytest suite -k correctness -q -p no:cacheprovider -rf --impl cutile --impl triton
               --grid decode)
      step dd-prime 150 "${dd_ours[@]}" -n 16 --dist load --compile-candidates
      step dd-tune 150 "${dd_ours[@]}" --durations=10
      step dd-bench "${DD_BENCH_LIMIT:-280}" python3 -m pytest suite "${bench[@]}" --grid decode --timing graph "${dd_impls[@]/#/--impl=}" \
        --benchmark-json="$out/${DD_NAME:-dense-decode}.json"
      ;;
    dense-decode-checks)
      # the steps our entries route (not the non-causal 4 x 192, a dense-kernel class: a cold cuTile tune of 30 s a
      # test, which stopped session 61's first try at its limit): primed, checked, then the sanitize grid's again
      # under memcheck with their shape classes tuned (session 61: 18 passed; memcheck 6 passed, 0 errors)
      # 1 x 130, 1 x 300 and 1 x 4097: one page a sequence (no page size of 16-256 divides them; not yet on a GPU in
      # session 61)
      dd_edges=(-k "correctness and (s1x256 or s1x130 or s1x300 or s1x4097 or (s4x192 and causal))" -q -p no:cacheprovider -rf
                --impl cutile --impl triton)
      step dd-prime 150 python3 -m pytest suite "${dd_edges[@]}" --grid gpu --grid sanitize -n 16 --dist load \
        --compile-candidates
      step dd-edges 150 python3 -m pytest suite "${dd_edges[@]}" --grid gpu --grid sanitize
      step dd-memcheck 200 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest suite \
        "${dd_edges[@]}" --grid sanitize
      grep -E "ERROR SUMMARY|passed|failed" "$out/dd-memcheck.log" | tail -3
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
      rm -rf /tmp/correct-cache
      for pass in cold:300 warm:150; do
        name=correct-${pass%:*}
        # cold: empty tuning, cuTile and Triton compile caches (fresh folders); warm: the same folders again
        FMHA_TUNING_CACHE=/tmp/correct-cache/tuning CUDA_TILE_CACHE_DIR=/tmp/correct-cache/cutile \
          TRITON_CACHE_DIR=/tmp/correct-cache/triton step "$name" "${pass#*:}" python3 -m pytest suite \
          -k correctness --grid gpu -q -p no:cacheprovider -n "${WORKERS:-8}" --dist loadgroup --durations=40 \
          --heartbeat="$out/$name.heartbeat" --benchmark-json="$out/$name.json"
        python3 scripts/where_time_goes.py "$out/$name.json" "$out"/"$name".gw*.json --top 25 2>/dev/null \
          > "$out/$name.where" ; head -30 "$out/$name.where"
      done
      ;;
    serve)
      step decode-blog 200 python3 -m pytest suite "${bench[@]}" --grid decode --grid blog --timing eager \
        --timing graph --timing kernel --impl naive --impl sdpa --impl sdpa-cudnn --impl triton --impl cutile \
        --impl flash-attn4 --benchmark-json="$out/decode-blog.json"
      step serving 360 python3 -m pytest suite "${bench[@]}" --grid serving --grid varlen --timing graph \
        --timing eager --benchmark-json="$out/serving.json"
      ;;
    candidates)
      step candidates 330 python3 -m pytest tests/test_gpu_candidates.py -k "${CANDIDATES_SELECT:-cutile}" -q \
        -p no:cacheprovider -rf
      memcheck_candidates '*two-launch*' 120
      ;;
    narrow-window)
      # the persistent 128x256 with a window's far edge peeled at 128 keys (session 47; the paired one in the tuner's
      # space) on Mistral-7B's windowed 1 x 32K beside the space's peeled forms, outputs checked first (graph, settled)
      step narrow-window-probe 240 python3 scripts/tuner_probe.py --case mistral-7b-bf16-causal-h32:8-s32768x32768-d128-w4096:0 \
        --methods graph settled --repeats 2 --match '*peeled*' --match '128x256*persistent*' --peeled-of '128x256*persistent*'
      grep -h '"tflops"' "$out/narrow-window-probe.log"
      ;;
    memcheck)
      sixteen='*16}*'  # default: the 16-warp candidates
      memcheck_candidates "${CANDIDATES:-$sixteen}" "${MEMCHECK_LIMIT:-200}" "${MEMCHECK_SELECT:-cutile and unit}"
      ;;
    causal)
      step causal 200 python3 scripts/sweep.py --seqlens 1024 2048 4096 8192 16384 --causal causal \
        --which sdpa cutile --match 'sdpa-cudnn' --match 'cutile:128x128:*8}*' --match 'cutile:64x128:*' \
        --out "$out/causal-sweep.json"
      ;;
    causal-deep)
      # the causal persistent forms with loads 2 / 4 tiles ahead (132 KB of pipeline at D=128 against 99 KB at
      # 3 / 6; the 128x256 one at D=64: 116 KB against 83), fixed share and dynamic, beside both at 3 / 6, one
      # block per tile, cuDNN and flash-attn4 if carried
      for d in 128 64; do
        step "causal-deep-d$d" 200 python3 scripts/sweep.py --d "$d" --seqlens 2048 4096 16384 --causal causal \
          --which sdpa cutile --match sdpa-cudnn --match flash-attn4 --match "cutile:64x128:{'occupancy': 2}:L2,4:g-auto" \
          --match "cutile:128x128:*8}:L2,4:g-auto" --match "cutile:128x128:*8}:L[23],[46]:persistent:g-auto" \
          --match "cutile:128x128:*8}:L[23],[46]:persistent:dynamic:g-auto" \
          --match "cutile:128x256:*8}:L[23],[46]:persistent:g-auto" --out "$out/causal-deep-d$d.json"
      done
      ;;
    prefill)
      # PREFILL_REST_MS: --rest-ms (default auto; session 46 published blog/fa3 with 1000 before every benchmark)
      step prefill "${PREFILL_LIMIT:-560}" python3 -m pytest suite --benchmark-only -p no:cacheprovider -q --grid blog --grid fa3 \
        --timing graph --rest-ms "${PREFILL_REST_MS:-auto}" --impl cutile --impl flash-attn4 --impl sdpa-cudnn --impl triton \
        --benchmark-json="$out/prefill.json"
      ;;
    ladder)
      step ladder 300 python3 -m pytest suite --benchmark-only -p no:cacheprovider -q --grid blog --timing graph \
        --rest-ms "${PREFILL_REST_MS:-auto}" --impl 'cutile-*' --benchmark-json="$out/ladder.json"
      ;;
    prefill-prime)
      step prefill-prime 540 python3 -m pytest suite -k correctness -q -p no:cacheprovider -rf --grid blog --grid fa3 \
        --impl cutile --impl triton --impl sdpa-cudnn --durations=5
      ;;
    models)
      # --isolate: one process per implementation (a device fault costs only its own cases); the children's
      # files under $out (FMHA_ISOLATE_DIR; not TMPDIR, where FlashInfer's JIT leaves nvcc's temporary files, too many
      # to come back) come back even if the step limit stops the parent before it merges them
      mkdir -p "$out/isolate"
      impl_options "${MODELS_IMPLS:-cutile triton flex sdpa* flash-attn4 flashinfer}"
      read -ra extra <<< "${MODELS_ARGS:-}"  # e.g. "--settle-max-ms 1500"
      name=${MODELS_NAME:-models}  # a second run of the part in one call writes beside the first
      # MODELS_REST_MS: --rest-ms (default auto, the suite's: a second's idle after much longer calls; session 46
      # published models with 1000 before every benchmark; docs/usage.md's --rest-ms)
      FMHA_ISOLATE_DIR=$out/isolate step "$name" "${MODELS_LIMIT:-570}" python3 -m pytest suite "${bench[@]}" --grid models \
        --timing graph --energy-ms "${ENERGY_MS:-1000}" --rest-ms "${MODELS_REST_MS:-auto}" "${impls[@]}" "${extra[@]}" --isolate \
        --benchmark-json="$out/$name.json"
      # at most 8 files come back from a call: the children's JSONs and logs travel as one archive
      tar czf "$out/$name-isolate.tgz" -C "$out" isolate && rm -rf "$out/isolate"
      ;;
    tune-out)  # this machine's tuning cache as $OUT/tuning-cache.tgz: unpack it here into .gpu-tune/ and carry it
      tar czf "$out/tuning-cache.tgz" -C "$FMHA_TUNING_CACHE" . && echo "tune-out: $(ls "$FMHA_TUNING_CACHE" | tr '\n' ' ')"
      ;;
    models-prime)
      # PRIME_CANDIDATES=0 leaves the candidates' softcap checks out, for a cold tune (about 470 s on an H200,
      # session 28) within one call: MODELS_TUNE_LIMIT
      if [ "${PRIME_CANDIDATES:-1}" != 0 ]; then
        step softcap-candidates 200 python3 -m pytest tests/test_gpu_candidates.py -k "cutile and cap" -q \
          -p no:cacheprovider -rf
      fi
      step models-tune "${MODELS_TUNE_LIMIT:-300}" python3 -m pytest suite -k correctness -q -p no:cacheprovider -rf \
        --grid models --impl cutile --impl triton --impl flex --impl sdpa-cudnn --durations=8
      ;;
    fi-models|fi-aot)  # fi-models: the models preset alone, the models chain's second call without .gpu-fi-aot
      if [ "$part" = fi-models ]; then grids=models limit=560; else grids=${FI_GRIDS:-models serving varlen} limit=${FI_LIMIT:-540}; fi
      step "$part" "$limit" python3 -m pytest suite -k correctness -q -p no:cacheprovider -rf --impl flashinfer \
        $(printf -- '--grid %s ' $grids) --durations=8
      fi_aot
      ;;
    gqa)
      step gqa 100 python3 scripts/sweep.py --seqlens 4096 --causal causal --dtype fp16 bf16 --hkv 32 8 \
        --which sdpa cutile --tuner-space --match sdpa-cudnn --match flash-attn4 --match 'cutile:*' \
        --out "$out/gqa-sweep.json"
      ;;
    tails)
      step tails-candidates 250 python3 -m pytest tests/test_gpu_candidates.py -k cutile -q -p no:cacheprovider -rf
      step tails-models 170 python3 -m pytest suite "${bench[@]}" --grid models -k "phi3 or deepseek" --timing graph \
        --impl cutile --impl triton --impl sdpa-cudnn --benchmark-json="$out/tails-models.json"
      step tails-sweep 150 python3 scripts/sweep.py --d 96 --seqlens 4096 16384 --which sdpa cutile --tuner-space \
        --match 'sdpa-cudnn' --match 'cutile:*' --out "$out/tails-sweep.json"
      ;;
    noncausal)
      # issue 15's largest gap (fa3 non-causal, flash-attn4 ahead by 5-11%): the space's candidates beside shapes it
      # leaves out, settled time, outputs checked first: at D=64 the 16-warp 256x128 (128 B of stack on sm_90,
      # never timed there) and the persistent 128x256 at latencies 2 / 4; at D=128 the persistent 128x256 (not in
      # the non-causal space; sm_90, tileiras 13.5: 165 KB of pipeline and no stack with whole key tiles, against
      # 198 KB for the persistent 128x128)
      dims=" ${NONCAUSAL_DIMS:-64 128} "  # one call may take one head dim, the next the other
      [[ $dims == *" 64 "* ]] && step noncausal-d64 280 python3 scripts/tuner_probe.py --methods settled --case fp16-full-h32:32-s4096x4096-d64-b4 \
        --case fp16-full-h32:32-s16384x16384-d64 --add tile_m=256,tile_n=128,num_worker_warps=16 \
        --add tile_m=256,tile_n=128,num_worker_warps=16,persistent=1 --add tile_n=256,persistent=1
      [[ $dims == *" 128 "* ]] && step noncausal-d128 250 python3 scripts/tuner_probe.py --methods settled --case fp16-full-h16:16-s4096x4096-d128-b4 \
        --case fp16-full-h16:16-s16384x16384-d128 --add tile_n=256,persistent=1 \
        --add tile_n=256,persistent=1,k_latency=3,v_latency=6
      grep -h picks "$out"/noncausal-d*.log
      ;;
    tuner)
      step tuner 300 python3 scripts/tuner_probe.py --wide-persistent --case fp16-causal-h32:32-s2048x2048-d128-b4 \
        --case fp16-causal-h32:32-s8192x8192-d128-b4 --case llama3-8b-bf16-causal-h32:8-s4096x4096-d128-b4 \
        --case llama3-70b-tp8-bf16-causal-h8:1-s4096x4096-d128-b4 --case llama3-8b-bf16-causal-h32:8-s32768x32768-d128 \
        --case gpt2-bf16-causal-h12:12-s32768x32768-d64
      grep picks "$out/tuner.log"
      ;;
    groups)
      # causal heads ordered heaviest-first together: the tuner's automatic group (8 MB of K/V, counted by query
      # head) against 16 / 32 / 128 heads, on the short causal cases where our kernels trail most
      step groups 540 python3 scripts/tuner_probe.py --methods graph --head-groups 16 32 128 \
        --match '64x128:*2}:L2,4:g-auto' --match '128x128:*8}:L2,4:g-auto' --match '128x64:*' --match '256x64:*' \
        --case llama3-70b-tp8-bf16-causal-h8:1-s4096x4096-d128-b4 --case gpt2-bf16-causal-h12:12-s4096x4096-d64-b4 \
        --case gemma2-9b-global-bf16-causal-h16:8-s4096x4096-d256-cap50-b4 \
        --case deepseek-v3-mla-tp8-bf16-causal-h16:16-s4096x4096-d192-dv128-b4 \
        --case llama3-8b-bf16-causal-h32:8-s4096x4096-d128-b4 --case fp16-causal-h32:32-s4096x4096-d128-b4 \
        --case qwen2.5-7b-bf16-causal-h28:4-s4096x4096-d128-b4
      grep picks "$out/groups.log"
      ;;
    paired)
      # the persistent 128x256 causal candidate with its blocks taking mirror pairs of query tiles (Variant.paired)
      # beside its every-num_blocks-th share and the tuner's usual one-block-per-tile picks (graph time)
      step paired 480 python3 scripts/tuner_probe.py --methods graph --match '*persistent*' \
        --match '64x128:*2}:L2,4:g-auto' --match '128x128:*8}:L2,4:g-auto' --match '128x256:*8}:L2,4:g-auto' \
        --match '256x64:*' --case llama3-70b-tp8-bf16-causal-h8:1-s4096x4096-d128-b4 \
        --case gpt2-bf16-causal-h12:12-s4096x4096-d64-b4 --case qwen2.5-7b-bf16-causal-h28:4-s4096x4096-d128-b4 \
        --case mistral-7b-bf16-causal-h32:8-s4096x4096-d128-w4096:0-b4 --case fp16-causal-h32:32-s2048x2048-d128-b4 \
        --case llama3-70b-tp8-bf16-causal-h8:1-s32768x32768-d128 --case gpt2-bf16-causal-h12:12-s32768x32768-d64 \
        --case llama3-8b-bf16-causal-h32:8-s4096x4096-d128-b4 --case phi3-mini-bf16-causal-h32:32-s4096x4096-d96-b4 \
        --case fp16-causal-h32:32-s4096x4096-d128-b4
      grep picks "$out/paired.log"
      ;;
    paired-more)
      # the tuner's one-block-per-tile picks again as persistent blocks with a paired share (tuner_probe.py
      # --paired-of), beside themselves and the persistent 128x256 forms (graph time)
      step paired-more 480 python3 scripts/tuner_probe.py --methods graph --match '*persistent*' \
        --match '64x128:*2}:L2,4:g-auto' --match '128x128:*8}:L2,4:g-auto' --match '256x64:*' \
        --paired-of '64x128:*2}:L2,4:g-auto' --paired-of '128x128:*8}:L2,4:g-auto' --paired-of '256x64:*' \
        --case gpt2-bf16-causal-h12:12-s4096x4096-d64-b4 --case gpt2-bf16-causal-h12:12-s32768x32768-d64 \
        --case phi3-mini-bf16-causal-h32:32-s4096x4096-d96-b4 --case phi3-mini-bf16-causal-h32:32-s32768x32768-d96 \
        --case llama3-8b-bf16-causal-h32:8-s4096x4096-d128-b4 --case qwen2.5-7b-bf16-causal-h28:4-s4096x4096-d128-b4 \
        --case mistral-7b-bf16-causal-h32:8-s4096x4096-d128-w4096:0-b4 \
        --case deepseek-v3-mla-tp8-bf16-causal-h16:16-s4096x4096-d192-dv128-b4 \
        --case fp16-causal-h32:32-s4096x4096-d128-b4 --case fp16-causal-h32:32-s2048x2048-d128-b4
      grep picks "$out/paired-more.log"
      ;;
    settled)
      # burst against sustained clocks, by candidate (tuner_probe.py --methods graph settled), with the usual picks
      # and the two-launch forms (their outputs checked first); session 20's call 4
      step settled 480 python3 scripts/tuner_probe.py --methods graph settled --repeats 1 --match '*persistent*' \
        --match '128x128:*8}:L3,6:g-auto' --match '64x128:*2}:L2,4:g-auto' --two-launch-of '128x256:*persistent:g-auto' \
        --two-launch-of '128x128:*8}:L3,6:g-auto' --case mistral-7b-bf16-causal-h32:8-s32768x32768-d128-w4096:0 \
        --case llama3-8b-bf16-causal-h32:8-s4096x4096-d128-b4 --case fp16-causal-h32:32-s2048x2048-d128-b4 \
        --case gpt2-bf16-causal-h12:12-s32768x32768-d64 --case llama3-8b-bf16-causal-h32:8-s32768x32768-d128 \
        --case deepseek-v3-mla-tp8-bf16-causal-h16:16-s4096x4096-d192-dv128-b4 --case fp16-causal-h32:32-s4096x4096-d128-b4
      grep picks "$out/settled.log"
      ;;
    peeled)
      # the causal diagonal's masked tiles as straight-line code after the mask-free loop (Variant.peel_diagonal:
      # sm_90 pipeline 99/132 -> 165 KB at D=128, 149 -> 214 KB for MLA) beside the same candidates with the
      # masked loop, one block a tile and persistent paired; outputs checked first, then graph and settled time
      local_cases=${PEELED_CASES:-"fp16-causal-h32:32-s2048x2048-d128-b4 fp16-causal-h32:32-s16384x16384-d128-b4
        llama3-8b-bf16-causal-h32:8-s4096x4096-d128-b4 llama3-70b-tp8-bf16-causal-h8:1-s4096x4096-d128-b4
        deepseek-v3-mla-tp8-bf16-causal-h16:16-s4096x4096-d192-dv128-b4"}
      extra=()  # PEELED_GLOBS: more candidate labels to time, each with its peeled twin (e.g. '128x64:*8}*')
      for glob in ${PEELED_GLOBS:-}; do extra+=(--match "$glob" --peeled-of "$glob"); done
      probe_cases peeled "$local_cases" "$tuner_picks" python3 scripts/tuner_probe.py --methods graph settled --repeats 1 \
        --match '128x128:*8}:L*:g-auto' --match '*persistent*' --match '64x128:*2}:L2,4:g-auto' \
        --paired-of '128x128:*8}:*:g-auto' --peeled-of '128x128*' --peeled-of '64x128*' "${extra[@]}"
      ;;
    narrow)
      # the persistent 128x256 with the causal diagonal peeled at 128 keys (kernel peel_narrow; sm_90 pipeline
      # 161 -> 225 KB at D=128, 81 -> 129 KB at D=64, no stack) beside its loop form, the 128x128 peeled pick and
      # D=64's 256x64: outputs checked first, then settled time
      local_cases=${NARROW_CASES:-"fp16-causal-h32:32-s4096x4096-d128-b4 fp16-causal-h32:32-s16384x16384-d128-b4
        llama3-8b-bf16-causal-h32:8-s4096x4096-d128-b4 llama3-8b-bf16-causal-h32:8-s32768x32768-d128
        gpt2-bf16-causal-h12:12-s32768x32768-d64"}
      probe_cases narrow "$local_cases" "$tuner_picks" python3 scripts/tuner_probe.py --methods settled --repeats 1 --check \
        --match '128x256*persistent*' --match '128x128*persistent:paired:peeled*' --match '256x64*'
      ;;
    extras)
      probe() {  # probe GROUP "CASE ..." ARGS...: tuner_probe.py's settled time of the matched and added candidates
        local group=$1 cases=$2; shift 2
        probe_cases "extras-$group" "$cases" "$tuner_picks" python3 scripts/tuner_probe.py --methods settled \
          --repeats 1 "$@"
      }
      for group in ${EXTRAS:-full-wide d256 d256-wide d64 mla}; do
        case "$group" in
          full-wide) probe "$group" "fp16-full-h16:16-s2048x2048-d128-b8 fp16-full-h16:16-s4096x4096-d128-b4
              fp16-full-h16:16-s16384x16384-d128" --match '*persistent*' \
              --add tile_n=256,persistent=1,k_latency=3,v_latency=6 --add tile_n=256,persistent=1,k_latency=2,v_latency=4 \
              --add tile_n=256,persistent=1,k_latency=4,v_latency=4 ;;
          d256) probe "$group" "gemma2-9b-global-bf16-causal-h16:8-s32768x32768-d256-cap50
              gemma2-9b-global-bf16-causal-h16:8-s4096x4096-d256-cap50-b4" --add tile_n=32 \
              --add tile_n=32,k_latency=3,v_latency=6 --add tile_n=128 --add tile_n=64,num_worker_warps=16 ;;
          d256-wide) probe "$group" "gemma2-9b-global-bf16-causal-h16:8-s32768x32768-d256-cap50
              gemma2-9b-local-bf16-causal-h16:8-s32768x32768-d256-w4096:0-cap50
              gemma2-9b-local-bf16-causal-h16:8-s4096x4096-d256-w4096:0-cap50-b4" --match '128x64*' --add tile_n=128 \
              --add tile_n=128,k_latency=3,v_latency=6 --add tile_n=128,persistent=1,k_latency=3,v_latency=6 ;;
          d64) probe "$group" "gpt2-bf16-causal-h12:12-s32768x32768-d64 fp16-causal-h32:32-s4096x4096-d64-b4
              fp16-causal-h32:32-s16384x16384-d64" --match '256x64*' --match '*persistent*' \
              --add peel_diagonal=1 --add peel_diagonal=1,k_latency=3,v_latency=6 \
              --add persistent=1,paired=1,peel_diagonal=1,k_latency=3,v_latency=6 ;;
          deferred) probe "$group" "deepseek-v3-mla-tp8-bf16-causal-h16:16-s4096x4096-d192-dv128-b4
              deepseek-v3-mla-tp8-bf16-causal-h16:16-s32768x32768-d192-dv128 llama3-8b-bf16-causal-h32:8-s4096x4096-d128-b4
              gemma2-9b-global-bf16-causal-h16:8-s32768x32768-d256-cap50" --match '128x128*' --match '128x64:*8}*' ;;
          deferred-paired) probe "$group" "fp16-causal-h32:32-s2048x2048-d128-b4 fp16-causal-h32:32-s4096x4096-d128-b4
              llama3-8b-bf16-causal-h32:8-s4096x4096-d128-b4 llama3-70b-tp8-bf16-causal-h8:1-s4096x4096-d128-b4" \
              --match '128x128*peeled*' --add persistent=1,paired=1,peel_diagonal=1,defer_pv=1 ;;
          d64-narrow)
            probe "$group" "gpt2-bf16-causal-h12:12-s32768x32768-d64 fp16-causal-h32:32-s16384x16384-d64
              fp16-causal-h32:32-s4096x4096-d64-b4" --match '256x64*' --add tile_n=64 \
              --add tile_n=64,k_latency=3,v_latency=6 --add tile_n=64,persistent=1,paired=1 --add tile_n=64,peel_diagonal=1 \
              --add tile_n=64,persistent=1,paired=1,peel_diagonal=1 --add tile_n=64,defer_pv=1
            probe "$group-full" "fp16-full-h32:32-s16384x16384-d64 fp16-full-h32:32-s4096x4096-d64-b4" --match '256x64*' \
              --add tile_n=64 --add tile_n=64,k_latency=3,v_latency=6 --add tile_n=64,persistent=1,k_latency=3,v_latency=6 \
              --add tile_n=64,persistent=1 ;;
          clusters) probe "$group" "fp16-full-h16:16-s4096x4096-d128-b4 fp16-full-h16:16-s16384x16384-d128
              fp16-causal-h32:32-s2048x2048-d128-b4 fp16-causal-h32:32-s4096x4096-d128-b4" --match '128x128*persistent*' \
              --match '*peeled*' --add tile_m=256,num_ctas=2 --add tile_m=256,num_ctas=2,k_latency=3,v_latency=6 ;;
          mla) probe "$group" "deepseek-v3-mla-tp8-bf16-causal-h16:16-s4096x4096-d192-dv128-b4
              deepseek-v3-mla-tp8-bf16-causal-h16:16-s32768x32768-d192-dv128" --match '128x128*' \
              --add tile_n=64 --add tile_n=64,peel_diagonal=1 --add tile_n=64,peel_diagonal=1,k_latency=3,v_latency=6 \
              --add tile_n=64,persistent=1,paired=1,peel_diagonal=1,k_latency=3,v_latency=6 ;;
          *) echo "extras: no group $group" ;;
        esac
      done
      ;;
    narrow-check)
      FMHA_CANDIDATES='*128x256*peeled*' step narrow-edges 240 python3 -m pytest tests/test_gpu_candidates.py \
        -k cutile -q -p no:cacheprovider -rf
      memcheck_candidates '*128x256*peeled*' 240 cutile
      ;;
    window)
      # issue 13's windowed cases (session 21): a window's far-edge tiles in the diagonal's masked loop, and the
      # persistent candidates a causal window adds to the space. Every windowed cuTile candidate on the edge
      # cases (ids with a window from 100 keys: -w1..), then each candidate's settled time (tuner_probe.py)
      step window-candidates 240 python3 -m pytest tests/test_gpu_candidates.py -k "cutile and w1" -q \
        -p no:cacheprovider -rf
      step window 240 python3 scripts/tuner_probe.py --methods settled --repeats 1 \
        --case mistral-7b-bf16-causal-h32:8-s32768x32768-d128-w4096:0 \
        --case gemma2-9b-local-bf16-causal-h16:8-s32768x32768-d256-w4096:0-cap50
      grep picks "$out/window.log"
      ;;
    tuner-ab)
      read -ra grids <<< "${TUNER_GRIDS:-models blog}"
      grid_args=(); for grid in "${grids[@]}"; do grid_args+=(--grid "$grid"); done
      for t in ${TUNERS:-exhaustive settled}; do
        step "tuner-$t" 560 env FMHA_TUNER="$t" FMHA_TUNING_CACHE="/tmp/fmha/tuning-$t" python3 -m pytest suite \
          "${bench[@]}" "${grid_args[@]}" -k causal --timing graph --impl cutile --benchmark-json="$out/tuner-$t.json"
      done
      ;;
    plans)
      local_cases=${PLANS_CASES:-$(printf 'llama3-70b-tp8-paged-bf16-h8:1-q1-%s ' kv32768-uniform-p16-d128-b64 \
          kv32768-uniform-p16-d128-b16 kv8192-uniform-p16-d128-b256 kv8192-uniform-p64-d128-b64 \
          kv512-uniform-p16-d128-b64; printf 'llama3-8b-paged-bf16-h32:8-q1-%s ' kv8192-uniform-p16-d128-b64 \
          kv8192-uniform-p16-d128-b256 kv32768-uniform-p16-d128)}
      read -ra plans_args <<< "${PLANS_ARGS:-}"  # more probe options, e.g. "--deep-tile 128,4,7"
      probe_cases plans "$local_cases" '"case".*"variant"' python3 scripts/serving_probe.py --skip-varlen --no-cutile \
        --triton "${PLANS_MODE:-plans}" --peer flashinfer --peer triton "${plans_args[@]}"
      ;;
    mla)
      step mla-sweep 240 python3 scripts/sweep.py --d 192 --dv 128 --seqlens 4096 16384 --causal causal \
        --which sdpa cutile --tuner-space --match 'sdpa-cudnn' --match 'flash-attn4' --match 'cutile:*' \
        --out "$out/mla-sweep.json"
      ;;
    decode-wide)
      # the long uniform serving cases where FlashInfer led ours by 0.5-2.2% in session 11: Triton's wider decode
      # space beside FlashInfer, timed the same way in one process (carry .gpu-fi; cuTile not needed)
      step decode-wide 420 python3 scripts/serving_probe.py --skip-varlen --no-cutile --triton wide \
        --peer flashinfer --peer triton \
        --case llama3-8b-paged-bf16-h32:8-q1-kv8192-uniform-p16-d128-b256 \
        --case llama3-8b-paged-bf16-h32:8-q1-kv32768-uniform-p16-d128-b64 \
        --case llama3-8b-paged-bf16-h32:8-q1-kv2048-uniform-p16-d128-b256 \
        --case llama3-70b-tp8-paged-bf16-h8:1-q1-kv32768-uniform-p16-d128-b64 \
        --case llama3-70b-tp8-paged-bf16-h8:1-q1-kv8192-uniform-p16-d128-b256
      ;;
    toolchains)
      # TOOLCHAINS (default "134 135") picks which run here; the machine stays the same over back-to-back calls
      picks=(--match sdpa-cudnn --match 'cutile:*16}*' --match "cutile:64x128:{'occupancy': 2}:L2,4:g-auto"
             --match "cutile:128x64:{'occupancy': 2}:L2,4:g-auto" --match "cutile:128x128:*8}:L2,4:g-auto"
             --match "cutile:128x128:*8}:L3,6:persistent:g-auto" --match "cutile:128x256:*8}:L3,6:persistent:g-auto"
             --match "cutile:128x256:*8}:L2,4:g-auto")  # the last: the tuner's causal pick at D=96
      for tc in ${TOOLCHAINS:-134 135}; do
        for d in ${TC_DIMS:-128 64}; do (  # a subshell: the toolchain's settings stay in it
          if [ "$tc" = 135 ]; then
            source scripts/tileiras135_env.sh
          else
            export CUDA_TILE_CACHE_DIR=/tmp/fmha/cutile134 FMHA_CUTILE_BYTECODE=
          fi
          sweep=(python3 scripts/sweep.py --d "$d" --which sdpa cutile "${picks[@]}")
          for mask in causal full; do  # compile every candidate first, two processes side by side
            timeout 200 "${sweep[@]}" --seqlens 2048 --causal $mask --check-only > "$out/check-$tc-d$d-$mask.log" 2>&1 &
          done
          wait
          step "sweep-$tc-d$d" 200 "${sweep[@]}" --seqlens 2048 4096 16384 --causal both --out "$out/sweep-$tc-d$d.json"
        ) done
      done
      ;;
    tall)
      # head dim 64 with 256 query rows a block (two warpgroups of 128 rows, 64-key tiles) beside the tuner's
      # usual picks and cuDNN (sweep)
      step tall 420 python3 scripts/sweep.py --d 64 --seqlens 2048 4096 8192 16384 --causal both \
        --which sdpa cutile --match sdpa-cudnn --match 'cutile:256x64*' --match 'cutile:128x64:*' \
        --match "cutile:64x128:{'occupancy': 2}:L2,4:g-auto" --match "cutile:128x128:*8}:L2,4:g-auto" \
        --match "cutile:128x128:*8}:L3,6:persistent:g-auto" --match 'cutile:128x256:*' --out "$out/tall-sweep.json"
      ;;
    d64causal)
      # the persistent 128x256 causal candidate at head dims 33-64: the edge cases (and under memcheck), then
      # the fa3 D=64 causal and GPT-2 benchmarks with the tuner's pick beside cuDNN
      FMHA_CANDIDATES='*128x256*persistent*' step d64-candidates 150 python3 -m pytest tests/test_gpu_candidates.py \
        -k "cutile and (d64 or d40)" -q -p no:cacheprovider -rf
      memcheck_candidates '*128x256*persistent*' 150 "cutile and unit and (d64 or d40)"
      step d64-bench 280 python3 -m pytest suite "${bench[@]}" --grid fa3 --grid models -k "(d64 and causal) or gpt2" \
        --timing graph --impl cutile --impl sdpa-cudnn --benchmark-json="$out/d64.json"
      ;;
    decode-probe)
      # the serving cases where a peer led ours in session 10, as the probe times them (graph of 20 calls)
      step decode-probe 300 python3 scripts/serving_probe.py --skip-varlen \
        --case llama3-70b-tp8-paged-bf16-h8:1-q1-kv512-uniform-p16-d128-b256 \
        --case llama3-70b-tp8-paged-bf16-h8:1-q1-kv2048-uniform-p16-d128-b256 \
        --case llama3-70b-tp8-paged-bf16-h8:1-q1-kv8192-uniform-p16-d128-b256 \
        --case llama3-8b-paged-bf16-h32:8-q1-kv512-uniform-p16-d128-b256 \
        --case llama3-8b-paged-bf16-h32:8-q1-kv2048-uniform-p16-d128-b256
      ;;
    profile)
      read -r -a peers <<< "${PROFILE_PEERS:-flash-attn4 sdpa-cudnn}"
      sections=(SpeedOfLight ComputeWorkloadAnalysis WarpStateStats InstructionStats MemoryWorkloadAnalysis LaunchStats
                Occupancy SchedulerStats)
      mkdir -p /tmp/profile
      ncu_case() {  # ncu_case NAME SWEEP_ARGS...: one profiled call of each matched candidate, its details as CSV
        local name=$1; shift
        step "profile-$name" 120 ncu --clock-control none --nvtx --nvtx-include "profile/" "${sections[@]/#/--section=}" \
          -f -o "/tmp/profile/$name" python3 scripts/sweep.py --profile --which sdpa cutile --tuner-space \
          "${peers[@]/#/--match=}" "$@"
        ncu --import "/tmp/profile/$name.ncu-rep" --csv --page details > "$out/profile-$name.csv"
      }
      ncu_case d64full --d 64 --seqlens 4096 --causal full --match 'cutile:256x64*L2,4:g-auto'
      ncu_case d128full --d 128 --seqlens 4096 --causal full --match 'cutile:128x128*L3,6:persistent:g-auto'
      ncu_case causal2k --d 128 --seqlens 2048 --causal causal \
        --match 'cutile:128x128*L3,6:persistent:planned:peeled*'
      tar -czf "$out/profile.tgz" -C "$out" $(cd "$out" && ls profile-*) && rm -f "$out"/profile-*
      ;;
    clocks)
      for impl in ${CLOCK_IMPLS:-cutile sdpa-cudnn triton}; do  # a process each (one segfaulted after cutile)
        step "clocks-$impl" 120 python3 scripts/clock_probe.py --case llama3-8b-bf16-causal-h32:8-s4096x4096-d128-b4 \
          --impl "$impl" --seconds 2.5
      done
      ;;
    settle)
      for run in 0a 250a 0b 250b; do
        step "settle-$run" 150 python3 -m pytest suite "${bench[@]}" --grid varlen -k "equal or s4096x4096" \
          --timing graph --impl cutile --impl sdpa-cudnn --impl triton --settle-ms "${run%?}" \
          --benchmark-json="$out/settle-$run.json"
      done
      ;;
    rest)
      # does a case's time depend on the case before it? The models preset's 4 x 4K cases timed after the 1 x 32K
      # ones (the whole preset) and alone (-k s4096), each without and with --rest-ms REST_MS (default 1000);
      # REST_IMPLS (default "sdpa-cudnn sdpa-flash": nothing to tune). Session 36: cutile ran one kernel 12% apart
      # on Llama-3-8B and Mistral-7B 4 x 4K (the window hides nothing there): first in its process, and right after a heavy case
      # REST_GRID / REST_ALONE: another preset and the pytest -k of its cases timed alone (default models / s4096;
      # e.g. serving and "b64- and kv8192": does a decode step move with the case before it?)
      impl_options "${REST_IMPLS:-sdpa-cudnn sdpa-flash}"
      for run in all-0 short-0 all-rest short-rest; do
        select=(); [ "${run%-*}" = short ] && select=(-k "${REST_ALONE:-s4096}")
        ms=0; [ "${run#*-}" = rest ] && ms=${REST_MS:-1000}
        FMHA_ISOLATE_DIR=/tmp/rest-isolate step "rest-$run" 200 python3 -m pytest suite "${bench[@]}" --grid "${REST_GRID:-models}" \
          --timing graph "${impls[@]}" "${select[@]}" --rest-ms "$ms" --isolate --benchmark-json="$out/rest-$run.json"
      done
      ;;
    fp8|fp8-bench)
      impl_options "${FP8_IMPLS:-cutile triton sdpa}"
      if python3 -c "import flashinfer" 2>/dev/null; then impls+=(--impl flashinfer); fi
      if [ "$part" = fp8 ]; then
        step fp8-twins 200 python3 -m pytest suite -k "correctness and kvfp8" -q -p no:cacheprovider -rf \
          --grid serving-cpu "${impls[@]}" --impl naive
        step fp8-checks "${FP8_LIMIT:-380}" python3 -m pytest suite -k correctness -q -p no:cacheprovider -rf \
          --grid serving-fp8 "${impls[@]}" --durations=8
      else  # a JSON per model, so that a step cut while it tunes loses one half (publish_results.py joins them)
        for model in llama3-8b llama3-70b; do
          step "fp8-bench-$model" "${FP8_LIMIT:-285}" python3 -m pytest suite "${bench[@]}" --grid serving-fp8 \
            --timing graph "${impls[@]}" -k "$model" --benchmark-json="$out/serving-fp8-$model.json"
        done
      fi
      ;;
    ab)
      read -ra ab_impls <<< "${AB_IMPLS:-triton flashinfer}"
      ab_select=${AB_SELECT:-"(llama3-8b and kv8192-uniform-p16 and q1 and b64-) or (llama3-8b and kv2048-uniform-p16 \
and q1 and b256-) or (kv8192-uniform-p16 and q1 and b256-) or (llama3-8b and q1-kv131072-uniform-p16-d128-graph)"}
      ab_end=$(( $(date +%s) + ${AB_LIMIT:-470} ))
      for pass in $(seq -w 1 "${AB_PASSES:-3}"); do  # equal widths: the files sort in pass order
        for impl in "${ab_impls[@]}"; do
          left=$(( ab_end - $(date +%s) )); [ "$left" -lt 20 ] && break 2
          step "ab-$impl-$pass" "$left" python3 -m pytest suite "${bench[@]}" --grid "${AB_GRID:-serving}" \
            --timing "${AB_TIMING:-graph}" --impl "$impl" -k "$ab_select" --benchmark-json="$out/ab-$impl-$pass.json"
        done
      done
      if compgen -G "$out/ab-*.json" >/dev/null; then
        python3 scripts/ab_summary.py --ours "${ab_impls[0]}" "$out"/ab-*.json | tee "$out/ab-summary.txt"
      else echo "ab: no run wrote a JSON (AB_SELECT matched no case?)"; fi
      ;;
    wide)
      step wide "${WIDE_LIMIT:-300}" python3 -m pytest tests/test_gpu_candidates.py tests/test_registry.py -q \
        -p no:cacheprovider -rf --durations=8 -k "b4097 or grid_axis or past_one_grid"
      ;;
    fp8-dots)
      step fp8-dots-checks 240 python3 -m pytest tests/test_serving.py tests/test_gpu_candidates.py -q \
        -p no:cacheprovider -rf -k "any_magnitude or (serving and kvfp8)"
      probe_cases fp8-dots "${FP8_DOTS_CASES:-$(fp8_cases)}" . python3 scripts/serving_probe.py --fp8-dots
      ;;
    prefetch)
      step prefetch-checks 240 python3 -m pytest tests/test_serving.py -q -p no:cacheprovider -rf -k prefetches_under_pdl
      PYTORCH_NO_CUDA_MEMORY_CACHING=1 step prefetch-memcheck 240 compute-sanitizer --tool memcheck \
        --error-exitcode 9 python3 -m pytest tests/test_serving.py -q -p no:cacheprovider -rf \
        -k "prefetches_under_pdl and 96"
      grep -E "ERROR SUMMARY|passed|failed" "$out/prefetch-memcheck.log" | tail -2
      ;;
    fp8-words)
      # the Triton decode's fp8 values read as 32-bit words (V_WORDS) against bytes: its tests (also under memcheck,
      # without PyTorch's caching allocator), the fp8 twins, then serving_probe.py --triton-switch V_WORDS on the
      # serving-fp8 preset's fp8 cases (FP8_WORDS_CASES: case ids instead)
      step fp8-words-checks 240 python3 -m pytest tests/test_serving.py -q -p no:cacheprovider -rf \
        -k "words or any_magnitude"
      PYTORCH_NO_CUDA_MEMORY_CACHING=1 step fp8-words-memcheck 240 compute-sanitizer --tool memcheck \
        --error-exitcode 9 python3 -m pytest tests/test_serving.py -q -p no:cacheprovider -rf -k words
      grep -E "ERROR SUMMARY|passed|failed" "$out/fp8-words-memcheck.log" | tail -2
      step fp8-words-twins 200 python3 -m pytest suite -k "correctness and kvfp8" -q -p no:cacheprovider -rf \
        --grid serving-cpu --impl triton
      probe_cases fp8-words "${FP8_WORDS_CASES:-$(fp8_cases)}" '"variant"' python3 scripts/serving_probe.py \
        --triton-switch V_WORDS --no-cutile
      ;;
    pdl)
      # the Triton decode launched with and without programmatic dependent launch (config PDL): its tests, then
      # serving_probe.py --triton-switch PDL beside PDL_PEERS (default flashinfer) on PDL_CASES (case ids; default:
      # the serving cases with 64+ sequences where a peer led in session 43)
      step pdl-checks 200 python3 -m pytest tests/test_serving.py -q -p no:cacheprovider -rf -k "programmatic or fitted"
      peers=(); for peer in ${PDL_PEERS:-flashinfer}; do peers+=(--peer "$peer"); done
      probe_cases pdl "${PDL_CASES:-$(behind_cases)}" '"variant"' python3 scripts/serving_probe.py \
        --triton-switch PDL --no-cutile "${peers[@]}"
      ;;
    varlen-probe)
      step varlen-candidates 300 python3 -m pytest tests/test_gpu_candidates.py -k "serving or uneven" -q \
        -p no:cacheprovider
      step varlen-probe 280 python3 scripts/serving_probe.py --varlen-only ${VARLEN_PROBE_ARGS:-}
      ;;
    varlen-peel)
      # the packed prefill's peeled candidates (session 48): checked on the uneven batches and with windows they
      # peel, then each beside its masked loop on the varlen and models-serving prefills, then under memcheck
      FMHA_CANDIDATES='*peeled*' step varlen-peel-candidates 200 python3 -m pytest tests/test_gpu_candidates.py \
        -k "varlen_candidate" -q -p no:cacheprovider -rf
      for grid in varlen models-serving; do
        step "varlen-peel-$grid" "${VARLEN_PEEL_LIMIT:-120}" python3 scripts/serving_probe.py --varlen-only \
          --varlen-peel --varlen-grid "$grid"
      done
      MEMCHECK_SHARDS=${MEMCHECK_SHARDS:-4} memcheck_candidates '*peeled*' 200 varlen_candidate
      ;;
    varlen-memcheck)
      # each cuTile varlen candidate on its own under memcheck (a fault ends the process's CUDA context, so one run
      # for all stops at the first), without PyTorch's caching allocator (exact allocation bounds), for each output
      # store of VARLEN_STORES (default: plain tma; FMHA_VARLEN_STORE), all processes at once (the compiles take
      # most of the time); session 22 saw errors at the write of the run-time tensor map of the TMA store
      labels=$(python3 -c "from impls.cutile.serving import varlen_space
for v in varlen_space((9, 0), 128, True): print(v.label().replace(' ', '?'))")
      set -f  # the labels are globs for FMHA_CANDIDATES, not for the shell
      runs=()  # "LOG STORE LABEL" of each process
      for store in ${VARLEN_STORES:-plain tma}; do
        i=0
        for label in $labels; do
          i=$((i + 1)) name=varlen-memcheck-$store-$i
          runs+=("$name $store $label")
          FMHA_VARLEN_STORE=$store PYTORCH_NO_CUDA_MEMORY_CACHING=1 FMHA_CANDIDATES="$label" \
            step "$name" 240 compute-sanitizer --tool memcheck --error-exitcode 9 \
            python3 -m pytest tests/test_gpu_candidates.py -k "uneven" -q -p no:cacheprovider > /dev/null &
        done
      done
      wait
      for run in "${runs[@]}"; do
        read -r name store label <<< "$run"
        echo "$store $label: $(grep -m1 -E 'ERROR SUMMARY' "$out/$name.log") $(grep -E 'passed|failed' "$out/$name.log" \
          | tail -1)"
      done
      set +f
      bundle_logs varlen-memcheck
      ;;
    dynamic)
      step dynamic 150 python3 scripts/sweep.py --seqlens 2048 8192 16384 --causal both --which sdpa cutile \
        --match 'sdpa-cudnn' --match '*dynamic*' --match "cutile:64x128:{'occupancy': 2}:L2,4:g-auto" \
        --match "cutile:128x128:{'occupancy': 1, 'num_worker_warps': 8}:L3,6:g-auto" \
        --match "cutile:128x128:{'occupancy': 1, 'num_worker_warps': 8}:L3,6:persistent:g-auto" \
        --out "$out/dynamic-sweep.json"
      ;;
    node|node-correct|node-bench)
      # issue 14's evidence, PER_GPU workers a GPU (default: the cores / GPUs); logs in $out/<part>-logs.tgz. The
      # cold passes (node-correct) fill the caches the warm ones and the blog part (node-bench, the next call on the
      # same machine) start from: NODE_PASSES picks passes by name (default: the part's own)
      gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
      per_gpu=${PER_GPU:-$(( $(nproc) / gpus ))}
      logs=$(mktemp -d) results=$out
      python3 -c "import pytest; print('pytest', pytest.__version__)"
      case $part in
        node-correct) passes=${NODE_PASSES:-"cold-all cold-one"} ;;
        node-bench) passes=${NODE_PASSES:-"warm-all warm-one blog-prime fleet blog-one blog-all"} ;;
        *) passes=${NODE_PASSES:-"cold-all cold-one warm-all warm-one blog-prime fleet blog-one blog-all"} ;;
      esac
      correct=(python3 -m pytest suite -k correctness --grid gpu -q -p no:cacheprovider --dist loadgroup
               --max-worker-restart 2)
      blog_impls=(--impl cutile --impl triton --impl sdpa-cudnn --impl sdpa --impl flash-attn4)
      blog=(python3 -m pytest suite -k benchmark --grid blog --timing graph -q -p no:cacheprovider --rounds 7
            --round-ms 10 "${blog_impls[@]}")
      capped() { echo $(( ${NODE_PASS_S:-$1} < $1 ? ${NODE_PASS_S:-$1} : $1 )); }  # a pass's limit, NODE_PASS_S at most
      caches() {  # caches NAME: every tuning and compile cache in a folder of its own (a cold pass starts empty)
        export FMHA_TUNING_CACHE=/tmp/$1/tuning CUDA_TILE_CACHE_DIR=/tmp/$1/cutile TRITON_CACHE_DIR=/tmp/$1/triton \
          TORCHINDUCTOR_CACHE_DIR=/tmp/$1/inductor
      }
      (
        out=$logs
        for pass in $passes; do
          case $pass in cold-one|warm-one) caches node-one ;; *) caches node-all ;; esac
          case $pass in  # the correctness preset over all GPUs and over one, cold then warm; blog's checks tune
            cold-all|warm-all)
              step "correct-$pass-${gpus}gpu" "$(capped "$([ "$pass" = cold-all ] && echo 240 || echo 90)")" "${correct[@]}" \
                -n $((per_gpu * gpus)) --heartbeat="$logs/$pass.hb" --benchmark-json="$logs/$pass.json" ;;
            cold-one|warm-one)
              CUDA_VISIBLE_DEVICES=0 step "correct-$pass-1gpu" "$(capped "$([ "$pass" = cold-one ] && echo 330 || echo 90)")" \
                "${correct[@]}" -n "$per_gpu" --heartbeat="$logs/$pass.hb" --benchmark-json="$logs/$pass.json" ;;
            blog-prime)  # the blog shapes' tuning, one case a worker, so that the benchmarks below time no tune
              step blog-prime 220 python3 -m pytest suite -k correctness --grid blog -q -p no:cacheprovider \
                "${blog_impls[@]}" -n "$gpus" --dist load ;;
            fleet)  # the fleet check of blog: every benchmark on every GPU
              step fleet 150 "${blog[@]}" -n "$gpus" --dist each --benchmark-json="$results/fleet-blog.json" ;;
            blog-one)
              CUDA_VISIBLE_DEVICES=0 step blog-1gpu 70 "${blog[@]}" -n 1 --benchmark-json="$results/blog-1gpu.json" ;;
            blog-all)
              step "blog-${gpus}gpu" 60 "${blog[@]}" -n "$gpus" --dist loadgroup \
                --benchmark-json="$results/blog-${gpus}gpu.json" ;;
            *) echo "unknown node pass: $pass" >&2 ;;
          esac
        done
      )
      python3 - "$logs"/*.hb <<'PY'
import sys  # each pass's span from its heartbeats
from pathlib import Path
from suite.isolation import heartbeat_span
for path in map(Path, sys.argv[1:]):
    done, span = heartbeat_span(path)
    print(f"{path.name}: {done} tests finished, first start to last finish {span:.0f} s")
PY
      tar -czf "$out/$part-logs.tgz" -C "$logs" .
      ;;
    *) echo "unknown part: $part" >&2; exit 2 ;;
  esac
done
