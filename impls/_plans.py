"""How our kernels plan their work, shared by the Triton and cuTile families: split-KV decode plans, the combine's
cut, the persistent varlen work plan, the mixed step's work list, the decode tuners' shape class, and the route of a
decode-shaped dense call through the paged decode. Private to our kernels; the contract (``impls.contract``) knows
nothing of it.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from impls._registry import Prepared, Unsupported, get
from impls.contract import NO_WINDOW, UNBOUNDED, MixedBatch, PagedKV, decode_shaped
from impls.tuning import TuningCache, fastest

# Our decode kernels run the dots of bf16 queries over an fp8 cache in fp16 (``fp16_dots``; each kernel's module
# docstring says how): each query row is first multiplied by a power of two that puts its largest |q| in
# [2**F16_ROW_EXP, 2**(F16_ROW_EXP + 1)), below fp16's largest finite 65504 with room to spare, and 27 binary orders
# of magnitude above where fp16 leaves its normal range.
F16_ROW_EXP = 13

# Decode-shaped dense calls (``decode_shaped``) can run our split-KV decode over the dense cache seen as pages, nothing
# copied: the dense kernels, one block per (batch, head), read 1.5-1.7 TB/s there (H200) where cuDNN read 3.8-4.0.
# See docs/design.md#split-kv-and-work-plans.
# The view's page: the largest of these that cuts every cache into whole pages, else the whole cache.
DENSE_PAGE_SIZES = (256, 128, 64, 32, 16)
DENSE_DECODE_ENV = "FMHA_DENSE_DECODE"  # "0": dense entries run their dense kernel on decode shapes too


def dense_as_paged(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> PagedKV | None:
    """A decode-shaped dense call (``decode_shaped``; q ``(B, Hq, Sq, D)``, k and v ``(B, Hkv, Skv, D)``, head
    dims at unit stride) as paged decode over views of the same memory: q as ``(B, Sq, Hq, D)``, each cache as
    ``(num_pages, P, Hkv, D)`` with P the largest of DENSE_PAGE_SIZES that divides Skv (else Skv: a page a
    sequence), a block table of each sequence's pages and every length Skv. None where the call is not
    decode-shaped, or k and v are laid out apart, or no page size cuts the caches: a sequence's rows must start a
    whole number of pages apart (the contract's layout and flash-attn's (B, Skv, Hkv, D) both do)."""
    batch, _, sq, head_dim = q.shape
    kv_heads, skv = k.shape[1], k.shape[2]
    step_b, step_h, step_s, _ = k.stride()
    if (not decode_shaped(sq, skv, causal) or v.shape != k.shape or v.stride() != k.stride() or step_s <= 0
            or min(k.stride()) < 0):
        return None
    fits = [p for p in (*DENSE_PAGE_SIZES, skv) if skv % p == 0 and (batch == 1 or step_b % (p * step_s) == 0)]
    if not fits:
        return None
    page = fits[0]
    per_sequence = skv // page
    sequence_step = step_b // (page * step_s) if batch > 1 else 0  # pages from one sequence's first to the next's
    size = ((batch - 1) * sequence_step + per_sequence, page, kv_heads, head_dim)
    k_pages, v_pages = (t.as_strided(size, (page * step_s, step_s, step_h, 1)) for t in (k, v))
    table = torch.arange(batch)[:, None] * sequence_step + torch.arange(per_sequence)[None, :]
    return PagedKV(q.transpose(1, 2), k_pages, v_pages, table.to(device=q.device, dtype=torch.int32),
                   torch.full((batch,), skv, dtype=torch.int32, device=q.device))


def decode_route(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float,
                 dense: Callable[[], Prepared], tuning: TuningCache, window: tuple[int, int] = NO_WINDOW,
                 softcap: float = 0.0) -> Prepared:
    """This dense call through ``name``'s paged decode (``dense_as_paged``, its output in the dense layout) or
    through ``dense()``, the entry's dense kernel: whichever is faster for the decode's shape class, timed once on an
    idle GPU and kept in ``tuning`` (the family's cache); the decode where nothing is timed (the interpreter, a shared
    GPU). Not a decode step, or DENSE_DECODE_ENV "0": ``dense()``. A step the decode refuses: ``dense()``, its config
    saying why. H200, the `decode` preset: the decode took 1 x 32K from 308 to 136 us (cuTile) and 346 to 130
    (Triton), but 16 x 1K from 13.3 to 16.5 and 15.4 to 17.4: hence the timing."""
    paged = dense_as_paged(q, k, v, causal) if os.environ.get(DENSE_DECODE_ENV, "1") != "0" else None
    if paged is None:
        return dense()
    try:
        decode = get(name, "paged").prepare(paged, scale=scale, window=window, softcap=softcap)
    except Unsupported as exc:
        return dense().with_config(decode_route=f"split-KV decode refused: {exc}")
    routed = Prepared(lambda: decode.run().transpose(1, 2), config={
        "route": f"split-KV decode over the cache as pages of {paged.page_size}", **decode.config})
    if not timed_here(q):  # the interpreter: nothing to time
        return routed
    dense_kernel = functools.cache(dense)  # prepared once, whether timed, compiled or chosen
    shape = ("dense decode", *decode_shape_class(paged, paged.window_left(window), softcap))
    entry, source = tuning.lookup(tuning.key(q.device, shape),
                                  lambda: {"route": fastest([("decode", routed), ("dense", dense_kernel())])},
                                  lambda: {"route": "decode"}, dense_kernel, [1 + i for i in NEAR_DECODE])
    if entry["route"] == "dense":
        return dense_kernel().with_config(route="dense kernel (faster than the split-KV decode here)",
                                          route_chosen=source)
    return routed.with_config(route_chosen=source)


def timed_here(q: torch.Tensor) -> bool:
    """Whether the route of a call on q's device can be timed (on a GPU)."""
    return q.is_cuda


def fp16_dots(inputs: PagedKV) -> bool:
    """Whether our decode kernels run this batch's dots in fp16 (their F16_DOT): bf16 queries over an fp8 cache,
    since e4m3 widens to fp16 in one instruction per two elements and to bf16 only through a second conversion."""
    return inputs.kv_fp8 and inputs.q.dtype == torch.bfloat16


def dependent_launch_available(device: torch.device) -> bool:
    """Whether ``device`` runs programmatic dependent launch (Hopper and later): our decode kernels launch their
    split steps that way there (each kernel waits for the grid before it; the combine's launch overlaps the split
    kernel's last wave)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


# Split-KV decode plans, shared by our Triton and cuTile kernels. A chunk of the cache is at least
# SPLIT_MIN_TILES key tiles: shorter ones cost more in the combine than they add in parallelism. Chunks are
# sized so that every SM gets PROGRAMS_PER_SM blocks' worth of the batch's keys: by total tokens, not by the
# longest sequence, so a long-tailed batch splits its long sequences finely and leaves its short ones whole.
SPLIT_MIN_TILES = 4
PROGRAMS_PER_SM = 4
# The shortest chunks the tuners' plans allow (None: SPLIT_MIN_TILES): a short step takes as long as one program's chain
# of dependent loads, which one-tile chunks cut to one link (H200, the 70B slice's 1 x 512: 7.60 -> 4.70 us).
PLAN_MIN_TILES = (None, 1)
# The programs per SM the tuners' plans aim at: a batch whose plan lands just past a wave can take fewer or more chunks
# without another compiled kernel (H200, cuTile: a plan aimed at 1 was 4-18% slower on 6 of 7 cases).
AIMED_PLANS = (2, PROGRAMS_PER_SM, 8)
UNSPLIT_SLACK = 1.25  # a batch whose longest sequence is at most this many target chunks runs unsplit


def split_plan(lengths: list[int] | tuple[int, ...], kv_heads: int, block_n: int, sm_count: int,
               min_tiles: int | None = None, programs_per_sm: int = PROGRAMS_PER_SM,
               fit: bool = False) -> tuple[int, int]:
    """(num_splits, split_len): the longest sequence cut into equal chunks of whole key tiles, at least
    ``min_tiles`` long, about as long as the batch's tiles (over every kv head) shared among ``programs_per_sm``
    programs per SM (the target; a tuner may try several).

    A batch whose longest sequence is at most UNSPLIT_SLACK targets long runs unsplit, and the chunks are equal
    (8B 64 x 8K on an H200: 4.22 TB/s unsplit against 4.10 cut at the target, which left slivers). A long-tailed
    batch keeps the count rounded up: its longest sequences are the critical path.

    ``fit``: the shortest chunk whose programs that hold keys all fit in ``programs_per_sm`` x ``sm_count``
    slots at once (``fitted_chunk``), so the launch is whole waves with no tail."""
    min_tiles = SPLIT_MIN_TILES if min_tiles is None else min_tiles
    tiles = [-(-n // block_n) for n in lengths]
    longest = max(tiles)
    if fit:
        chunk = fitted_chunk(tiles, kv_heads, programs_per_sm * sm_count, min_tiles)
        return -(-longest // chunk), chunk * block_n
    target = max(min_tiles, -(-kv_heads * sum(tiles) // (programs_per_sm * sm_count)))
    splits = 1 if longest <= UNSPLIT_SLACK * target else min(-(-longest // target), longest // min_tiles)
    chunk = -(-longest // splits)
    return -(-longest // chunk), chunk * block_n


def fitted_chunk(tiles: list[int], kv_heads: int, slots: int, min_tiles: int) -> int:
    """The shortest chunk, in key tiles and at least ``min_tiles``, that cuts these sequences into at most
    ``slots`` programs over ``kv_heads`` kv heads (the longest sequence whole where even that is more). The
    count falls as the chunk grows, so a bisection finds it, as FlashInfer's decode plan sizes its chunks to the
    grid that fits the GPU at once."""
    longest = max(tiles)

    def programs(chunk: int) -> int:
        return kv_heads * sum(-(-t // chunk) for t in tiles)

    low, high = min(min_tiles, longest), longest
    while low < high:
        mid = (low + high) // 2
        low, high = (low, mid) if programs(mid) <= slots else (mid + 1, high)
    return low


def chunk_keys(length: int, split_len: int) -> list[int]:
    """The keys of each chunk of ``split_len`` that holds some of a ``length``-key cache, in order: the chunks the
    paged decode's combine merges (``ceil(length / split_len)`` of them)."""
    return [min(split_len, length - first) for first in range(0, length, split_len)]


def split_work_list(lengths: list[int] | tuple[int, ...], split_len: int) -> list[tuple[int, int]]:
    """A split decode's programs ``(sequence, chunk)``: one per chunk that holds keys (``chunk_keys``), those with
    the most keys first, so that the full chunks start in the first waves and the short ones fill in behind them.
    A grid of (chunks, sequences) launches the empty ones too (a long-tailed batch: most of them). A sequence of no
    keys keeps its chunk 0, which writes its zeros where the launch is unsplit (the combine reads none of it)."""
    items = [(keys, (seq, chunk)) for seq, length in enumerate(lengths)
             for chunk, keys in enumerate(chunk_keys(length, split_len) or [0])]
    return [item for _, item in sorted(items, key=lambda pair: -pair[0])]


COMBINE_STEP_ELEMENTS = 4096  # partial-output elements a combine program merges per step: 16 KB of fp32
COMBINE_MIN_TILE_D = 16


def combine_plan(num_splits: int, head_dim: int) -> tuple[int, int]:
    """How the combine cuts one row's merge: ``(tile_d, chunks)``, a program per ``tile_d`` slice of the head
    dim that merges ``chunks`` chunks per step.

    A step's loads are dependent round trips to memory (about a microsecond each), so the merge should take as
    few steps as it can: with many chunks (a long cache at batch 1: hundreds) the head-dim slice narrows until
    all of them fit in one step, and the row is merged by ``head_dim / tile_d`` programs instead of one."""
    chunks = 1 << max(num_splits - 1, 0).bit_length()
    tile_d = max(COMBINE_MIN_TILE_D, min(head_dim, COMBINE_STEP_ELEMENTS // chunks))
    return tile_d, min(chunks, COMBINE_STEP_ELEMENTS // tile_d)


def decode_shape_class(inputs: PagedKV, window_left: int = UNBOUNDED, softcap: float = 0.0) -> tuple:
    """What a decode autotuner's choice depends on: dtype, head dim, heads, new tokens, page size, and the
    batch, longest length read and spread of those lengths in powers of two; whether a window or softcap is
    compiled in, and an fp8 cache."""
    batch, sq, hq, head_dim = inputs.q.shape
    hkv, lengths = inputs.k_cache.shape[2], inputs.read_lengths(window_left)
    spread = round(math.log2(max(lengths) * len(lengths) / sum(lengths)))
    pow2 = [1 << (n - 1).bit_length() for n in (batch, max(lengths))]
    return ("paged", inputs.q.dtype, head_dim, hkv, hq // hkv, sq, inputs.page_size, *pow2, spread,
            *variant_tags(window_left < UNBOUNDED, softcap), *(("kv_fp8",) if inputs.kv_fp8 else ()))


# The positions of ``decode_shape_class`` a shipped pick carries across: the page size, batch, longest length read
# and their spread (a form the step's space lacks is passed over).
NEAR_DECODE = (6, 7, 8, 9)


def variant_tags(window: bool, softcap: float) -> tuple[str, ...]:
    """The model variants a call compiles in, as a serving tuner's shape class names them."""
    return ("window",) * window + ("softcap",) * (softcap > 0)


# Persistent varlen prefill: the host plans which block runs which query tiles, once, when the call is prepared
# (as FlashInfer's plan() does), and the kernel follows the plan. A work item is one query tile of one
# (sequence, head); its cost is counted in key tiles, plus PLAN_ITEM_OVERHEAD_TILES for what every item pays
# whatever its length (the Q load, the accumulator's start and the output's store).
PLAN_ITEM_OVERHEAD_TILES = 1


@dataclass(frozen=True)
class WorkPlan:
    """Block ``b`` of a persistent launch runs ``items[starts[b]:starts[b + 1]]`` in order; an item is
    ``(sequence * max_tiles + query_tile) * heads + head`` (``encode_item``)."""

    starts: tuple[int, ...]
    items: tuple[int, ...]
    max_tiles: int
    heads: int

    @property
    def blocks(self) -> int:
        return len(self.starts) - 1

    def decode(self, item: int) -> tuple[int, int, int]:
        """(sequence, query tile, head) of an item, as the kernel decodes it."""
        rest, head = divmod(item, self.heads)
        sequence, tile = divmod(rest, self.max_tiles)
        return sequence, tile, head


def query_tile_cost(tile: int, len_q: int, len_k: int, tile_m: int, tile_n: int, causal: bool,
                    window: tuple[int, int] = (UNBOUNDED, UNBOUNDED)) -> int:
    """Key tiles query tile ``tile`` of a (len_q, len_k) sequence visits, plus the per-item overhead: the tiles
    from the one holding the first key some row sees to the one holding the last (bottom-right: row i sits at key
    position i + len_k - len_q; causal, it sees no key after it; ``window``: the kernels' (left, right) bounds,
    ``window_bounds``), as the kernel's ``key_tiles`` counts them."""
    first_row = tile * tile_m + len_k - len_q
    left, right = window
    end = min(len_k, first_row + tile_m + (0 if causal else right))
    start = max(first_row - left, 0)
    return max(-(-end // tile_n) - start // tile_n, 0) + PLAN_ITEM_OVERHEAD_TILES


def varlen_work_plan(seqlens_q: list[int], seqlens_k: list[int], heads: int, tile_m: int, tile_n: int,
                     causal: bool, slots: int, window: tuple[int, int] = (UNBOUNDED, UNBOUNDED)) -> WorkPlan:
    """Share a packed batch's query tiles among at most ``slots`` persistent blocks, longest processing time
    first: units of work, heaviest first, each to the block with the least work so far.

    A unit is one query tile, or, causal, a mirror pair of one (sequence, head)'s tiles (its heaviest remaining
    and its lightest: every pair of a sequence costs the same, the dense kernel's ``paired`` share), heavy tile
    first. Units of equal cost keep the order sequence, head, pair, so that the blocks running at once share few
    heads' K/V, as in the dense kernel. Sequences without query rows give no work. ``window``: the kernels'
    (left, right) bounds, which make the tiles past a sequence's first window all cost the same.

    Equal pairs leave a last round: 768 pairs on 132 blocks give the busiest block 6 against a mean of 5.82, 3%
    of the launch idle (``split_tail``). So the trailing pairs, in that order, are split into their tiles where
    that shortens the busiest block's work: their light tiles fill the last round."""
    max_tiles = max(-(-n // tile_m) for n in seqlens_q)
    units = []  # (cost, items)
    for sequence, (len_q, len_k) in enumerate(zip(seqlens_q, seqlens_k, strict=True)):
        tiles = -(-len_q // tile_m)
        cost = [query_tile_cost(t, len_q, len_k, tile_m, tile_n, causal, window) for t in range(tiles)]
        if causal:  # mirror pairs, heavy tile first; an odd count's middle tile alone
            groups = [sorted({tiles - 1 - i, i}, reverse=True) for i in range((tiles + 1) // 2)]
        else:
            groups = [[t] for t in range(tiles)]
        for head in range(heads):
            for group in groups:
                units.append([(cost[t], (sequence * max_tiles + t) * heads + head) for t in group])
    shares = split_tail(units, max(min(slots, len(units)), 1))
    starts = (0, *itertools.accumulate(len(share) for share in shares))
    return WorkPlan(starts, tuple(itertools.chain.from_iterable(shares)), max_tiles, heads)


# split_tail's tries: the share of the trailing units split into their items, smallest first; a try is kept
# where its busiest block has at most SPLIT_TAIL_SLACK more work than the best try's.
SPLIT_TAIL_SHARES = (0, 1 / 16, 1 / 8, 1 / 4, 1 / 2, 1)
SPLIT_TAIL_SLACK = 1.002


def split_tail(units: list[list[tuple[int, int]]], blocks: int) -> list[list[int]]:
    """Each block's items: ``units`` (each a list of (cost, item) run together) shared longest processing time
    first (``longest_first``), with the trailing units split into their items. Of ``SPLIT_TAIL_SHARES`` the
    smallest share whose busiest block is within ``SPLIT_TAIL_SLACK`` of the best: a split unit's items may
    run on different blocks, the heavy one early and the light one late, where it fills a round that whole units
    leave part empty. Simulated, causal: GPT-2 1 x 32K (768 pairs of 256-row tiles, 132 blocks) 0.970 -> 0.997 of
    a perfect share, Phi-3 1 x 32K (4,096 pairs) 0.970 -> 1.000, four 4K sequences of 16 heads 0.970 -> 0.995."""
    fractions = SPLIT_TAIL_SHARES if any(len(unit) > 1 for unit in units) else (0,)
    tries = []
    for fraction in fractions:
        keep = len(units) - round(fraction * len(units))
        tries.append(longest_first(units[:keep] + [[item] for unit in units[keep:] for item in unit], blocks))
    best = min(busiest for busiest, _ in tries)
    return next(shares for busiest, shares in tries if busiest <= best * SPLIT_TAIL_SLACK)


def longest_first(units: list[list[tuple[int, int]]], blocks: int) -> tuple[int, list[list[int]]]:
    """(the busiest block's work, each block's items): units heaviest first (a stable sort: equal costs keep their
    order), each to the block with the least work so far."""
    costed = sorted(((sum(cost for cost, _ in unit), unit) for unit in units), key=lambda pair: -pair[0])
    load = [(0, block) for block in range(blocks)]  # a heap of (work so far, block)
    shares: list[list[int]] = [[] for _ in range(blocks)]
    for cost, unit in costed:
        work, block = heapq.heappop(load)
        shares[block].extend(item for _, item in unit)
        heapq.heappush(load, (work + cost, block))
    return max(work for work, _ in load), shares


def mixed_work_list(seqlens_q: list[int], seqlens: tuple[int, ...], tokens: int) -> list[tuple[int, int]]:
    """A mixed step's work items ``(sequence, first new token)``, one per ``tokens`` new tokens of a sequence, those
    that read the most keys first (a tile of new tokens t0..t1 of q_len reads ``L - q_len + t1 + 1`` keys), so that
    the long ones start in the first wave and the short ones fill in behind them."""
    items = [(seq, first) for seq, n in enumerate(seqlens_q) for first in range(0, n, tokens)]
    return sorted(items, key=lambda item: tile_keys(seqlens_q, seqlens, tokens, *item), reverse=True)


def tile_keys(seqlens_q: list[int], seqlens: tuple[int, ...], tokens: int, seq: int, first: int) -> int:
    """The keys a tile of ``tokens`` new tokens from ``first`` of sequence ``seq`` reads: ``L - q_len + t1 + 1``, its
    last token t1's."""
    return seqlens[seq] - seqlens_q[seq] + min(first + tokens, seqlens_q[seq])


# A mixed step whose programs (work items x kv heads) are at least this many a SM runs its decoding rows whole: the
# GPU is busy without a combine. Below it (the 70B slice's 64 decoding sequences: 64 programs on 132 SMs) the decoding
# sequences take the paged decode's split plan.
MIXED_WHOLE_PROGRAMS_PER_SM = 1


def decoding(seqlens_q: list[int]) -> list[int]:
    """The sequences of a mixed step that decode (one new token), in order: the split plan's rows (its slots)."""
    return [seq for seq, n in enumerate(seqlens_q) if n == 1]


def mixed_split_plan(seqlens_q: list[int], seqlens: tuple[int, ...], kv_heads: int, tokens: int, block_n: int,
                     sm_count: int, min_tiles: int | None = None) -> tuple[int, int]:
    """(num_splits, split_len) for a mixed step's decoding sequences: ``split_plan`` over their caches where the
    step's programs (a work item of ``tokens`` new tokens per kv head) are fewer than MIXED_WHOLE_PROGRAMS_PER_SM a
    SM, else (1, 0): nothing split. Prefill tiles are never split."""
    rows = decoding(seqlens_q)
    programs = kv_heads * sum(-(-n // tokens) for n in seqlens_q)
    if not rows or programs >= MIXED_WHOLE_PROGRAMS_PER_SM * sm_count:
        return 1, 0
    num_splits, split_len = split_plan([seqlens[seq] for seq in rows], kv_heads, block_n, sm_count, min_tiles)
    return (num_splits, split_len) if num_splits > 1 else (1, 0)


def mixed_split_work_list(seqlens_q: list[int], seqlens: tuple[int, ...], tokens: int,
                          split_len: int) -> list[tuple[int, int, int, int]]:
    """``mixed_work_list`` with each decoding sequence's item cut into its chunks of ``split_len`` keys (those that
    hold keys): items ``(sequence, first new token, chunk, slot)``, the slot a decoding sequence's index in
    ``decoding`` (where its chunks' partials go), -1 for the prefill tiles (chunk 0, their whole range). Those that
    read the most keys first, as in ``mixed_work_list``."""
    slot = {seq: i for i, seq in enumerate(decoding(seqlens_q))}
    items = []  # (keys read, item)
    for seq, first in mixed_work_list(seqlens_q, seqlens, tokens):
        if seq in slot:
            items += [(keys, (seq, 0, c, slot[seq])) for c, keys in enumerate(chunk_keys(seqlens[seq], split_len))]
        else:
            items.append((tile_keys(seqlens_q, seqlens, tokens, seq, first), (seq, first, 0, -1)))
    return [item for _, item in sorted(items, key=lambda pair: -pair[0])]


def mixed_work(inputs: MixedBatch, tokens: int, split_len: int = 0) -> torch.Tensor:
    """``mixed_work_list`` of a step as our mixed kernels read it: ``(items, 2)`` int32 on q's device, made when the
    call is prepared (a server builds its step's metadata once a step, outside the layers); ``split_len``: the
    decoding sequences cut so, ``mixed_split_work_list``'s ``(items, 4)``."""
    if split_len:
        items = mixed_split_work_list(inputs.seqlens_q(), inputs.seqlens, tokens, split_len)
    else:
        items = mixed_work_list(inputs.seqlens_q(), inputs.seqlens, tokens)
    return torch.tensor(items, dtype=torch.int32).to(inputs.q.device)
