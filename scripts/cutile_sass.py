"""Registers, stack (spills), shared memory and matrix instructions of each cuTile variant, without a GPU.

Needs ``cuobjdump`` (on PATH, or the one Triton ships). This is how the Hopper "trap" was diagnosed: the blog's
256x128 tile with one warpgroup needs about 5.4 KB of stack per thread on sm_90.
"""

from __future__ import annotations

import argparse

from impls._sass import sass_summary
from impls.cutile import LADDER, search_space
from impls.cutile.export import export_cubin


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--arch", default="sm_90")
    a = p.parse_args()
    capability = (int(a.arch[3:-1]), int(a.arch[-1]))
    named = [(name, v) for name, (v, _) in LADDER.items()]
    named += [(f"search: {v.tile_m}x{v.tile_n} {v.hints()} L{v.k_latency},{v.v_latency}", v)
              for v in search_space(capability)]
    for name, variant in named:
        print(f"{name:55s} {sass_summary(export_cubin(variant, arch=a.arch))}", flush=True)


if __name__ == "__main__":
    main()
