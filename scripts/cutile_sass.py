"""Registers, stack (spills), shared memory and matrix instructions of each cuTile variant, without a GPU.

Needs ``cuobjdump`` (on PATH, or the one Triton ships). This is how the Hopper "trap" was diagnosed: the blog's
256x128 tile with one warpgroup needs about 5.4 KB of stack per thread on sm_90.
"""

from __future__ import annotations

import argparse

from impls.cutile.export import export_phases
from impls.cutile.spaces import LADDER, search_space
from impls.sass import hgmma_runs, sass_summary, softmax_overlap


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--arch", default="sm_90")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--value-dim", type=int, default=None, help="V's head dim where it differs (MLA: 128 at 192)")
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--no-ladder", action="store_true")
    p.add_argument("--window", action="store_true", help="with the sliding-window masks (the ladder has none)")
    p.add_argument("--softcap", type=float, default=0.0, help="with this softcap (0: none)")
    p.add_argument("--runs", action="store_true",
                   help="also the HGMMAs issued between waits for them, in program order (a wait drains the tensor "
                        "cores: MLA's Q K^T ran as 8, a wait, 4 before session 49)")
    p.add_argument("--overlap", action="store_true",
                   help="also how many HGMMAs run between the softmax's exponentials, with no wait between (the "
                        "deferred P V's overlap, Variant.defer_pv; 0 where each product waits or is waited for)")
    a = p.parse_args()
    variants = {"window": a.window, "softcap": a.softcap, "value_dim": a.value_dim}
    capability = (int(a.arch[3:-1]), int(a.arch[-1]))
    plain = a.no_ladder or a.window or a.softcap  # the ladder runs neither window nor softcap
    named = [] if plain else [(name, v) for name, (v, _) in LADDER.items()]
    named += [(f"search: {v.label()}", v)
              for v in search_space(capability, a.head_dim, causal=a.causal, value_dim=a.value_dim)]
    for name, variant in named:
        for phase, cubin in export_phases(variant, arch=a.arch, head_dim=a.head_dim, causal=a.causal, **variants):
            runs = f" runs {hgmma_runs(cubin)}" if a.runs else ""
            overlap = f" overlap {softmax_overlap(cubin)}" if a.overlap else ""
            print(f"{name + phase:70s} {sass_summary(cubin)}{runs}{overlap}", flush=True)


if __name__ == "__main__":
    main()
