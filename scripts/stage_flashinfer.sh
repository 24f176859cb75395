#!/usr/bin/env bash
# Stage FlashInfer for the device machines (no network there; a call carries 64 MiB at most). Run here, in the
# project root: writes the git-ignored folder .gpu-fi/ (about 16 MB), to carry with one flash-attn-4 part:
#   run(command="source .gpu-env/env.sh && source scripts/flashinfer_env.sh && ...",
#       carry=[".gpu-env", ".gpu-fa4a", ".gpu-fi"])
# The wheel (62 MB zipped, 420 MB unpacked) is mostly CUDA sources of kernels other than attention (MoE, GEMM,
# sampling, experimental): its python package, the attention JIT sources (the top level of data/csrc) and the
# headers (include, cutlass, cccl, spdlog) stay; the subfolders of data/csrc and the non-Python files of
# experimental/, moe_ep/ and fused_moe/ go. Its import needs apache-tvm-ffi besides what the device image has.
set -euo pipefail
version=${FLASHINFER_VERSION:-0.7.2.post1}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64)
python3 -m pip download -q --no-deps -d "$work" "flashinfer-python==$version"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
  -d "$work" "apache-tvm-ffi>=0.1.11,<0.2"
mkdir -p "$work/site"
(cd "$work/site" && python3 -m zipfile -e "$work"/flashinfer_python-*.whl .)
find "$work/site/flashinfer/data/csrc" -mindepth 1 -maxdepth 1 -type d -exec rm -rf {} +
find "$work/site/flashinfer/experimental" "$work/site/flashinfer/moe_ep" "$work/site/flashinfer/fused_moe" \
  -type f ! -name '*.py' -delete
rm -rf .gpu-fi && mkdir -p .gpu-fi
tar -cf - -C "$work/site" . | xz -9 -T0 > .gpu-fi/flashinfer-site.tar.xz
cp "$work"/apache_tvm_ffi-*.whl .gpu-fi/
grep -qx '/.gpu-fi/' .git/info/exclude 2>/dev/null || echo '/.gpu-fi/' >> .git/info/exclude
du -sh .gpu-fi
