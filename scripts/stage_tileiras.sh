#!/usr/bin/env bash
# Stage tileiras 13.5 for the lent GPU in .gpu135/ (git-ignored; about 62 MB, one call's carry with .gpu-env, in
# place of .gpu): tileiras, ptxas, fatbinary and libnvvm of release 13.5.37, laid out as CUDA_HOME (bin/,
# nvvm/lib64/) as ../shared/gpu/rebuild.sh makes the 13.4 bundle, and that bundle's cuda-tile and pytest-benchmark
# wheels. Needs the package registry. On the device, `source scripts/tileiras135_env.sh` after .gpu-env/env.sh.
set -euo pipefail
version=13.5.37
root=$(git rev-parse --show-toplevel)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
plat=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux2014_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64)
shared=${SHARED:-$root/../shared}/gpu/cutile
python3 -m pip download -q --no-deps "${plat[@]}" -d "$tmp" nvidia-cuda-tileiras==$version \
  nvidia-cuda-nvcc==$version nvidia-nvvm==$version
mkdir -p "$tmp/ctk/bin" "$tmp/ctk/nvvm/lib64" "$tmp/ctk/lib" "$root/.gpu135"
unzip -q -o -j "$tmp"/nvidia_cuda_tileiras-*.whl 'nvidia/cu13/bin/tileiras' -d "$tmp/ctk/bin"
unzip -q -o -j "$tmp"/nvidia_cuda_nvcc-*.whl 'nvidia/cu13/bin/ptxas' 'nvidia/cu13/bin/fatbinary' -d "$tmp/ctk/bin"
unzip -q -o -j "$tmp"/nvidia_nvvm-*.whl 'nvidia/cu13/lib/libnvvm.so.4' -d "$tmp/ctk/nvvm/lib64"
ln -sf libnvvm.so.4 "$tmp/ctk/nvvm/lib64/libnvvm.so"
chmod +x "$tmp"/ctk/bin/*
tar -cf - -C "$tmp" ctk | xz -T2 -9e > "$root/.gpu135/cutile-toolchain-$version.tar.xz"
cp "$shared"/cuda_tile-*.whl "$shared"/pytest_benchmark-*.whl "$root/.gpu135/"
grep -qxF /.gpu135/ "$root/.gitignore" || echo /.gpu135/ >> "$root/.gitignore"
du -sk "$root/.gpu135" | awk '{print ".gpu135: " $1 " KiB (the carry limit is 65536 KiB with the tree and .gpu-env)"}'
