#!/usr/bin/env bash
# Stage tileiras 13.5 for the lent GPU in .gpu135/ (git-ignored; about 62 MB, one call's carry with .gpu-env):
# tileiras, ptxas, fatbinary and libnvvm of release 13.5.37, laid out as CUDA_HOME (bin/, nvvm/lib64/), as
# ../shared/gpu/rebuild.sh makes the 13.4 bundle. Needs the package registry. On the device, after a call that
# carried .gpu (cuda-tile installed under /tmp/site): `TOOLCHAINS=135 bash scripts/gpu_session.sh toolchains`
# unpacks it into /tmp/ctk135; with PATH=/tmp/ctk135/bin:$PATH CUDA_HOME=/tmp/ctk135 FMHA_CUTILE_BYTECODE=13.5
# the suite compiles our cuTile kernels as bytecode 13.5 (impls/cutile/toolchain.py).
set -euo pipefail
version=13.5.37
root=$(git rev-parse --show-toplevel)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
plat=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux2014_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64)
python3 -m pip download -q --no-deps "${plat[@]}" -d "$tmp" nvidia-cuda-tileiras==$version \
  nvidia-cuda-nvcc==$version nvidia-nvvm==$version
mkdir -p "$tmp/ctk/bin" "$tmp/ctk/nvvm/lib64" "$tmp/ctk/lib" "$root/.gpu135"
unzip -q -o -j "$tmp"/nvidia_cuda_tileiras-*.whl 'nvidia/cu13/bin/tileiras' -d "$tmp/ctk/bin"
unzip -q -o -j "$tmp"/nvidia_cuda_nvcc-*.whl 'nvidia/cu13/bin/ptxas' 'nvidia/cu13/bin/fatbinary' -d "$tmp/ctk/bin"
unzip -q -o -j "$tmp"/nvidia_nvvm-*.whl 'nvidia/cu13/lib/libnvvm.so.4' -d "$tmp/ctk/nvvm/lib64"
ln -sf libnvvm.so.4 "$tmp/ctk/nvvm/lib64/libnvvm.so"
chmod +x "$tmp"/ctk/bin/*
tar -cf - -C "$tmp" ctk | xz -T2 -9e > "$root/.gpu135/cutile-toolchain-$version.tar.xz"
grep -qxF /.gpu135/ "$root/.gitignore" || echo /.gpu135/ >> "$root/.gitignore"
du -sk "$root/.gpu135" | awk '{print ".gpu135: " $1 " KiB (the carry limit is 65536 KiB with the tree and .gpu-env)"}'
