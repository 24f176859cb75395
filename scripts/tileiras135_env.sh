# Source on the device machine after .gpu-env/env.sh: our cuTile kernels compiled by tileiras 13.5 as bytecode 13.5
# (blocks of 16 worker warps; impls/cutile/toolchain.py). Carry .gpu135/ (scripts/stage_tileiras.sh) in place of .gpu.
# - installs cuda-tile from .gpu135's wheels into /tmp/site unless a call of this machine did (env.sh, from .gpu);
# - unpacks the toolchain into /tmp/ctk135 once (13.4 stays in /tmp/ctk where a call carried .gpu);
# - puts it first on PATH and in CUDA_HOME, exports FMHA_CUTILE_BYTECODE=13.5 and a compile cache of its own.
if [ ! -d /tmp/site/cuda/tile ] && [ -d .gpu135 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu135/*.whl
fi
if [ ! -x /tmp/ctk135/bin/tileiras ] && [ -d .gpu135 ]; then
  mkdir -p /tmp/ctk135 && tar -xJf .gpu135/cutile-toolchain-*.tar.xz -C /tmp/ctk135 --strip-components=1
fi
if [ -x /tmp/ctk135/bin/tileiras ] && [ -d /tmp/site/cuda/tile ]; then
  case ":${PYTHONPATH:-}:" in *:/tmp/site:*) ;; *) export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} ;; esac
  export PATH=/tmp/ctk135/bin:$PATH CUDA_HOME=/tmp/ctk135 FMHA_CUTILE_BYTECODE=13.5 \
    CUDA_TILE_CACHE_DIR=${CUDA_TILE_CACHE_DIR:-/tmp/fmha/cutile}135
  python3 -c "from impls.cutile import toolchain; toolchain.enable(); print('cuTile:', toolchain.describe())" 2>&1 | tail -1
else
  echo "tileiras 13.5: not here (carry .gpu135, made by scripts/stage_tileiras.sh)"
fi
