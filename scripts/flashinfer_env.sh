# Source on the device machine after .gpu-env/env.sh: makes FlashInfer importable and its JIT able to compile.
# - unpacks .gpu-fi/ (scripts/stage_flashinfer.sh) into /tmp/fisite once; later calls of the same machine find
#   it there without carrying .gpu-fi again;
# - FlashInfer compiles with the image's nvcc. env.sh points CUDA_HOME at cuTile's tileiras toolchain
#   (/tmp/ctk: ptxas and libnvvm 13.4, no nvcc and no headers), which tileiras needs, so FlashInfer gets the
#   image's nvcc through FLASHINFER_NVCC and the image's headers and libraries linked into /tmp/ctk;
# - its JIT cache lives under /tmp/fmha/flashinfer, for the life of the machine;
# - modules compiled on an earlier machine travel as FlashInfer's own ahead-of-time artifacts: where
#   .gpu-fi-aot/flashinfer-aot.tar.xz is carried (the archive `gpu_session.sh fi-aot` brings back, copied there),
#   its .so files go to flashinfer/data/aot/NAME/NAME.so, which FlashInfer loads before it looks at its JIT (no
#   nvcc, no ninja, whatever CUDA_HOME is); a module not in it still compiles.
if [ ! -d /tmp/fisite/flashinfer ] && [ -d .gpu-fi ]; then
  mkdir -p /tmp/fisite && tar -xJf .gpu-fi/flashinfer-site.tar.xz -C /tmp/fisite \
    && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/fisite .gpu-fi/apache_tvm_ffi-*.whl
fi
if [ -d /tmp/fisite/flashinfer ] && [ ! -d /tmp/fisite/flashinfer/data/aot ] && [ -f .gpu-fi-aot/flashinfer-aot.tar.xz ]; then
  mkdir -p /tmp/fisite/flashinfer/data/aot && tar -xJf .gpu-fi-aot/flashinfer-aot.tar.xz -C /tmp/fisite/flashinfer/data/aot
  echo "flashinfer: $(ls /tmp/fisite/flashinfer/data/aot | wc -l) modules ahead of time (.gpu-fi-aot)"
fi
if [ -d /tmp/fisite/flashinfer ]; then
  export PYTHONPATH=/tmp/fisite${PYTHONPATH:+:$PYTHONPATH}
  _nvcc=$(PATH=$(echo "$PATH" | sed 's#/tmp/ctk/bin:##') command -v nvcc || ls /usr/local/cuda*/bin/nvcc 2>/dev/null | head -1)
  if [ -n "$_nvcc" ]; then
    export FLASHINFER_NVCC=$_nvcc
    _cuda=$(dirname "$(dirname "$(readlink -f "$_nvcc")")")
    if [ -n "${CUDA_HOME:-}" ] && [ "$CUDA_HOME" != "$_cuda" ]; then
      for _d in include lib64; do
        [ -e "$CUDA_HOME/$_d" ] || ln -s "$_cuda/$([ -d "$_cuda/$_d" ] && echo $_d || echo lib)" "$CUDA_HOME/$_d"
      done
    fi
  fi
  # FlashInfer's compile flags name CUDA_HOME, so ninja rebuilds every module when it differs from the call that
  # compiled them (session 28: fi-models without tileiras135_env.sh, models with it; FlashInfer recompiled in the
  # timed call and ran out of time): source the same env files in every call of a chain.
  _seen=/tmp/fmha/flashinfer/cuda_home
  mkdir -p /tmp/fmha/flashinfer
  if [ -f $_seen ] && [ "$(cat $_seen)" != "${CUDA_HOME:-}" ]; then
    echo "flashinfer: CUDA_HOME='${CUDA_HOME:-}' here, '$(cat $_seen)' when its JIT compiled: every module recompiles"
  fi
  [ -f $_seen ] || echo "${CUDA_HOME:-}" > $_seen
  export FLASHINFER_WORKSPACE_BASE=/tmp/fmha/flashinfer MAX_JOBS=${MAX_JOBS:-16} FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-9.0a}
  python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__, 'nvcc', '$_nvcc')" 2>&1 | tail -1
else
  echo "flashinfer: not here (carry .gpu-fi, made by scripts/stage_flashinfer.sh)"
fi
