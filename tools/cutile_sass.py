"""Registers, stack (spills), shared memory and matrix instructions of each cuTile variant, without a GPU.

Compiles the blog's ladder and the autotuner's candidates for the given shape with ``tileiras`` and reads the
SASS with ``cuobjdump`` (on PATH, or the one Triton ships). A spill shows as stack: this is how a tile too large
for one warpgroup's registers is found before it is timed (the blog's 256x128 tile with one warpgroup needs about
5.4 KB of stack per thread on sm_90). See docs/design.md#cutile-forward.
"""

from __future__ import annotations

import argparse

EPILOG = """examples:
  python -m tools.cutile_sass --head-dim 128
  python -m tools.cutile_sass --head-dim 192 --value-dim 128 --no-ladder --runs
  python -m tools.cutile_sass --head-dim 128 --window --overlap
  python -m tools.cutile_sass --mla 32 --kv-fp8
  python -m tools.cutile_sass --mixed 4 --mixed 8 --head-dim 128
"""
MLA_TILES = (16, 32, 64)  # key tiles of the MLA decode's split kernel compiled by --mla
MLA_WORKER_WARPS = (4, 8)
MLA_CACHE = 4096  # tokens: one sequence, split on one SM (only the launch's constants matter)


def report(args: argparse.Namespace) -> None:
    """One line per variant and kernel phase: its SASS summary, and the HGMMA runs or overlap if asked."""
    from impls.cutile.export import export_phases
    from impls.cutile.spaces import LADDER, search_space
    from impls.sass import hgmma_runs, sass_summary, softmax_overlap

    variants = {"window": args.window, "softcap": args.softcap, "value_dim": args.value_dim}
    capability = (int(args.arch[3:-1]), int(args.arch[-1]))
    plain = args.no_ladder or args.window or args.softcap  # the ladder has neither window nor softcap
    named = [] if plain else [(name, v) for name, (v, _) in LADDER.items()]
    named += [(f"search: {v.label()}", v)
              for v in search_space(capability, args.head_dim, causal=args.causal, value_dim=args.value_dim)]
    for name, variant in named:
        for phase, cubin in export_phases(variant, arch=args.arch, head_dim=args.head_dim, causal=args.causal,
                                          **variants):
            runs = f" runs {hgmma_runs(cubin)}" if args.runs else ""
            overlap = f" overlap {softmax_overlap(cubin)}" if args.overlap else ""
            print(f"{name + phase:70s} {sass_summary(cubin)}{runs}{overlap}", flush=True)


def report_mla(args: argparse.Namespace) -> None:
    """The MLA decode's split launch at DeepSeek-V3's widths (512 + 64, pages of 64) with ``args.mla`` query rows, in
    the shipped form and with each key tile and worker-warp count: one line each."""
    from dataclasses import replace

    from impls.cutile.export import export_launch
    from impls.cutile.mla_serving import MLA_FORM, MLACall
    from impls.sass import sass_summary
    from suite.presets import DEEPSEEK_V3_MLA_TP8, mla

    name, _, latent, rope = DEEPSEEK_V3_MLA_TP8
    case = mla((name, args.mla, latent, rope), 1, MLA_CACHE, kv_dtype="fp8" if args.kv_fp8 else "")
    inputs = case.make_inputs("cpu")
    for tile_n in MLA_TILES:
        for warps in MLA_WORKER_WARPS:
            form = replace(MLA_FORM, tile_n=tile_n, worker_warps=warps)
            _, kernel, arguments = MLACall(form, inputs, scale=inputs.scale(None), sm_count=1).launches[0]
            label = f"{tile_n} keys, {warps} worker warps" + (" (shipped)" if form == MLA_FORM else "")
            print(f"{label:40s} {sass_summary(export_launch(kernel, arguments, arch=args.arch))}", flush=True)


def report_mixed(args: argparse.Namespace) -> None:
    """One line per group: the mixed kernel's fixed form as it launches for a step of that group (one kv head, two
    decoding sequences beside a chunk, pages of --page-size) and its SASS summary."""
    from impls.cutile.export import export_launch
    from impls.cutile.mixed_serving import MixedCall
    from impls.sass import sass_summary
    from suite.presets import mixed

    for group in args.mixed:
        inputs = mixed(("", group, 1, args.head_dim), 2, 300, 1, 70, page_size=args.page_size).make_inputs("cpu")
        call = MixedCall(inputs, scale=args.head_dim ** -0.5)
        (_, kernel, arguments), = call.launches
        name = f"mixed: group {group}, {call.variant.describe()}"
        print(f"{name:70s} {sass_summary(export_launch(kernel, arguments, arch=args.arch))}", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.cutile_sass", description=__doc__, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="sm_90", help="the target (default sm_90)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--value-dim", type=int, default=None, help="V's head dim where it differs (MLA: 128 at 192)")
    parser.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--no-ladder", action="store_true", help="only the autotuner's candidates")
    parser.add_argument("--window", action="store_true", help="with the sliding-window masks (the ladder has none)")
    parser.add_argument("--softcap", type=float, default=0.0, help="with this softcap (0: none)")
    parser.add_argument("--runs", action="store_true",
                        help="also the HGMMAs issued between waits for them, in program order (a wait drains the "
                             "tensor cores: [8, 4] is one drain more than [12])")
    parser.add_argument("--overlap", action="store_true",
                        help="also how many HGMMAs run between the softmax's exponentials with no wait between "
                             "(the deferred P V's overlap, Variant.defer_pv; 0 where each product waits)")
    parser.add_argument("--mla", type=int, metavar="ROWS",
                        help="instead: the MLA decode's split kernel with ROWS query rows (heads x new tokens, at "
                             "most 32) at DeepSeek-V3's widths, over key tiles and worker warps")
    parser.add_argument("--kv-fp8", action="store_true", help="--mla over an fp8 (e4m3) latent cache")
    parser.add_argument("--mixed", type=int, action="append", default=[], metavar="GROUP",
                        help="instead: the mixed prefill and decode kernel at this many query heads a kv head "
                             "(repeatable)")
    parser.add_argument("--page-size", type=int, default=16, help="--mixed: the cache's page size (default 16)")
    args = parser.parse_args(argv)
    if args.mla is not None:
        from impls.cutile.mla_serving import MAX_ROWS

        if not 1 <= args.mla <= MAX_ROWS:
            parser.error(f"--mla takes 1 to {MAX_ROWS} query rows (the kernel packs at most that many), got {args.mla}")
        report_mla(args)
    elif args.mixed:
        report_mixed(args)
    else:
        report(args)


if __name__ == "__main__":
    main()
