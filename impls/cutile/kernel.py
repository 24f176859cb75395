"""FlashAttention forward in cuTile (``cuda.tile``), after NVIDIA's "Tuning Flash Attention in CUDA Tile".

A work item is one TILE_M tile of query rows of one (batch, query head): load that Q tile once, stream the
K/V tiles of the matching kv head (GQA by index) through an online softmax in base 2, normalise the float32
accumulator once at the end.

Every step of the blog's optimisation ladder is a compile-time switch of this one kernel:
- FAST_MATH:     exp2 with denormals flushed to zero, approximate final division (and softcap's tanh, not in
                 the blog: the hardware's approximate one);
- LOOP_SPLIT:    key tiles that every query row sees run without any mask; only the tiles at the causal
                 diagonal and the ragged end of Skv are masked (otherwise every tile is masked). As two loops,
                 or with MASK_BRANCH as the blog writes it: one loop whose tiles from ``mask_start`` on take
                 a masked branch at run time;
- REVERSE_ORDER: causal work runs heaviest first (last query tile first), which evens out the last wave;
                 with HEAD_GROUP > 1, heaviest first across that many heads at a time (not in the blog);
- tile shape:    TILE_M x TILE_N; occupancy, num_ctas and num_worker_warps are compiler hints set at launch;
- latencies:     how far ahead K and V loads are issued (the blog uses 2 for K, needed first in an iteration,
                 and 4 for V, needed only after the softmax);
- PERSISTENT:    not in the blog: one block per SM slot that takes work items in turn (the grid has one block
                 per item otherwise), so one block's K/V stream runs on from one item into the next.
- DYNAMIC:       not in the blog: a persistent block takes its next work item from an atomic counter instead
                 of every ``num_blocks``-th in turn. Causal items differ in length, and a fixed share leaves
                 some SMs idle at the end; a non-persistent grid gets this balance from the hardware scheduler.
- PAIRED:        not in the blog: the other cure for that, with a fixed share. A causal query tile t of num_m
                 sees about t + 1 key tiles, so tiles t and num_m - 1 - t of one head cost the same together: a
                 persistent block takes such mirror pairs in turn, heavy tile first (see ``paired_item``).
- PLANNED:       not in the blog: a persistent block runs the work items the host planned for it, as FlashInfer's
                 plan() does: mirror pairs shared longest-first, the trailing ones split into their tiles to fill
                 the last round that equal pairs leave part empty (``impls._plans.varlen_work_plan``; 768 pairs
                 on 132 blocks: the busiest runs 6 where the mean is 5.82).
- PHASE:         not in the blog: the masked tiles and the mask-free tiles in two launches of this kernel.
                 Any mask in the loop body keeps the compiler's K/V pipeline shallow (99-132 KB on sm_90, where
                 a mask-free loop gets 198 KB), so launch 1 (DIAGONAL) runs only the masked tiles of every query
                 tile and leaves its softmax state (running max, sum, unnormalised float32 accumulator) in a
                 workspace; launch 2 (OFF_DIAGONAL) starts from that state and runs only the mask-free tiles.
                 The online softmax does not care in which order key tiles arrive.
- DIAGONAL_TILES: not in the blog: where every causal query tile has the same few masked tiles (lengths in
                 whole tiles, ``Variant.peel_refusal``), they run as straight-line code after the mask-free loop
                 instead of in a second loop (and so do a window's far-edge tiles). The compiler then gives the
                 mask-free loop a deeper K/V pipeline (sm_90, 128x128: 165 KB instead of 99-132; 198 KB with a
                 window; MLA 214 instead of 149). Key tiles wider than query tiles peel in tiles of the query
                 tile's width (``peel_narrow``: the paired 128x256 161 -> 225 KB, no spill; with a window 165 ->
                 225 KB). No run-time ``if`` may wrap a masked tile that always runs: it costs the loop its depth.
- DEFER_PV:      not in the blog: each mask-free key tile's P V issued in the next step, beside that tile's
                 softmax (``free_tiles_deferred``), which the compiler then overlaps with it as FlashAttention-3
                 does; it does so by itself only in the non-causal persistent loop.
- TILE_D_TAIL:   not in the blog: a head dim that is not a power of two (cuTile tiles are) runs as one and a
                 narrower tail tile beside it (96 = 64 + 32, 80 = 64 + 16, 192 = 128 + 64) instead of padded to
                 the next power of two (128, 128, 256): up to a quarter less matrix work and accumulator. A
                 64-column tail comes from the first tile's load (``one_load``), so that the two products
                 run without a wait between them.

Measured on an H200 and dropped (docs/design.md#cutile-forward): FlashAttention-4's lazy rescaling, a
software-pipelined Q K^T, FlashAttention-4's exp2 on the FMA units for part of a tile (8-23% slower at head dim
64: the special-function unit is not what bounds this loop), and the PHASE halves as two loops of one persistent
launch.

Conventions (the suite's contract): causal is aligned bottom-right, i.e. query row i sees keys
j <= i + causal_offset with causal_offset = Skv - Sq (the blog's ``input_pos``); a row that sees no key
is written as zeros.
"""

from __future__ import annotations

import math
import types

import cuda.tile as ct

ConstInt = ct.Constant[int]
ConstBool = ct.Constant[bool]
ConstFloat = ct.Constant[float]

INV_LOG_2 = 1.0 / math.log(2)  # exp(x) == exp2(x * INV_LOG_2)
ZERO_PAD = ct.PaddingMode.ZERO  # ragged K/V tiles read zeros (0 * garbage could be NaN)
ONE_LOAD_TAIL = 64  # a head dim's tail tile this wide or wider comes from its first tile's load (head_and_tail)
# PHASE: the whole forward in one launch, or its masked / mask-free halves (see the module docstring).
WHOLE, DIAGONAL, OFF_DIAGONAL = 0, 1, 2
ARRAYS = ("Q", "K", "V", "Out", "MaxState", "SumState", "AccState", "NextItem", "WorkStarts", "WorkItems")


@ct.kernel
def fmha_fwd(
    Q, K, V, Out,
    MaxState, SumState, AccState, NextItem, WorkStarts, WorkItems,
    qk_scale: float,
    causal_offset: int,
    window_left: int, window_right: int,
    num_heads: int,
    group: int,
    # Q/K's head dim and V/Out's (the same unless MLA), each as a power-of-two tile and a narrower tail tile
    # beside it (0: none), as impls.cutile.head_tiles splits it
    TILE_D: ConstInt, TILE_D_TAIL: ConstInt, TILE_DV: ConstInt, TILE_DV_TAIL: ConstInt,
    TILE_M: ConstInt, TILE_N: ConstInt,
    CAUSAL: ConstBool, EVEN_N: ConstBool, HAS_WINDOW: ConstBool, SOFTCAP: ConstFloat,
    FAST_MATH: ConstBool, LOOP_SPLIT: ConstBool, MASK_BRANCH: ConstBool, REVERSE_ORDER: ConstBool,
    K_LATENCY: ConstInt, V_LATENCY: ConstInt, HEAD_GROUP: ConstInt, PERSISTENT: ConstBool, DYNAMIC: ConstBool,
    PAIRED: ConstBool, PLANNED: ConstBool, PHASE: ConstInt, DIAGONAL_TILES: ConstInt, DEFER_PV: ConstBool,
):
    """One block per work item (grid: query tiles x heads x batch), or PERSISTENT: a grid of one block per SM
    slot, each taking every ``num_blocks``-th item in turn. The state arrays (B, Hq, Sq) float32 for the max
    and the sum, (B, Hq, Sq, at least TILE_DV + TILE_DV_TAIL) for the accumulator, are read and written only by
    a split PHASE; NextItem (one int32, zero at launch) only by a DYNAMIC one; WorkStarts and WorkItems (int32, the
    host's plan: block b runs ``WorkItems[WorkStarts[b]:WorkStarts[b + 1]]``, each item
    ``(batch * num_m + query tile) * num_heads + head``) only by a PLANNED one.

    The three scheduling forms call ``attend_query_tile`` each with the same arguments. One ``while`` loop for
    all three (a non-persistent block running it once) compiles worse (sm_90 SASS): the persistent mask-free
    pipeline falls from 198 to 99 KB, and 128 x 64 tiles and head dim 64 start to spill."""
    num_m = ct.cdiv(Q.shape[2], TILE_M)
    num_bh = Q.shape[0] * num_heads
    heaviest_first = CAUSAL and REVERSE_ORDER and PHASE != DIAGONAL  # diagonal items are all alike
    num_items = num_m * num_bh
    if PERSISTENT and DYNAMIC:  # the first item by block index, every next one from the shared counter
        linear = ct.bid(0)
        while linear < num_items:
            tile_m, batch_head = work_item(linear, num_m, num_bh, heaviest_first, HEAD_GROUP)
            attend_query_tile(Q, K, V, Out, MaxState, SumState, AccState, tile_m, batch_head, qk_scale,
                              causal_offset, window_left, window_right, num_heads, group, TILE_D, TILE_D_TAIL,
                              TILE_DV, TILE_DV_TAIL, TILE_M, TILE_N, CAUSAL, EVEN_N, HAS_WINDOW, SOFTCAP, FAST_MATH,
                              LOOP_SPLIT, MASK_BRANCH, K_LATENCY, V_LATENCY, PHASE, DIAGONAL_TILES,
                              DEFER_PV=DEFER_PV)
            linear = ct.num_blocks(0) + ct.atomic_add(NextItem, 0, 1)
    elif PERSISTENT and PAIRED and heaviest_first:  # pair p: items 2p and 2p + 1 of the paired order
        for step in range(paired_steps(ct.bid(0), ct.num_blocks(0), num_items)):
            tile_m, batch_head = paired_item(paired_linear(step, ct.bid(0), ct.num_blocks(0), num_items), num_m)
            attend_query_tile(Q, K, V, Out, MaxState, SumState, AccState, tile_m, batch_head, qk_scale,
                              causal_offset, window_left, window_right, num_heads, group, TILE_D, TILE_D_TAIL,
                              TILE_DV, TILE_DV_TAIL, TILE_M, TILE_N, CAUSAL, EVEN_N, HAS_WINDOW, SOFTCAP, FAST_MATH,
                              LOOP_SPLIT, MASK_BRANCH, K_LATENCY, V_LATENCY, PHASE, DIAGONAL_TILES,
                              DEFER_PV=DEFER_PV)
    elif PERSISTENT and PLANNED:  # the host's plan: this block's items, in order, each read one item ahead
        start = ct.gather(WorkStarts, ct.bid(0)).item()
        item = ct.gather(WorkItems, start).item()  # gathers past the end read 0 (bounds-checked), and go unused
        for i in range(start, ct.gather(WorkStarts, ct.bid(0) + 1).item()):
            upcoming = ct.gather(WorkItems, i + 1).item()
            batch, tile_m, head = planned_item(item, num_m, num_heads)
            batch_head = batch * num_heads + head
            attend_query_tile(Q, K, V, Out, MaxState, SumState, AccState, tile_m, batch_head, qk_scale,
                              causal_offset, window_left, window_right, num_heads, group, TILE_D, TILE_D_TAIL,
                              TILE_DV, TILE_DV_TAIL, TILE_M, TILE_N, CAUSAL, EVEN_N, HAS_WINDOW, SOFTCAP, FAST_MATH,
                              LOOP_SPLIT, MASK_BRANCH, K_LATENCY, V_LATENCY, PHASE, DIAGONAL_TILES,
                              DEFER_PV=DEFER_PV)
            item = upcoming
    elif PERSISTENT:
        for linear in range(ct.bid(0), num_items, ct.num_blocks(0)):
            tile_m, batch_head = work_item(linear, num_m, num_bh, heaviest_first, HEAD_GROUP)
            attend_query_tile(Q, K, V, Out, MaxState, SumState, AccState, tile_m, batch_head, qk_scale,
                              causal_offset, window_left, window_right, num_heads, group, TILE_D, TILE_D_TAIL,
                              TILE_DV, TILE_DV_TAIL, TILE_M, TILE_N, CAUSAL, EVEN_N, HAS_WINDOW, SOFTCAP, FAST_MATH,
                              LOOP_SPLIT, MASK_BRANCH, K_LATENCY, V_LATENCY, PHASE, DIAGONAL_TILES,
                              DEFER_PV=DEFER_PV)
    else:
        tile_m, batch_head = work_item(block_item(num_m, num_heads), num_m, num_bh, heaviest_first, HEAD_GROUP)
        attend_query_tile(Q, K, V, Out, MaxState, SumState, AccState, tile_m, batch_head, qk_scale,
                          causal_offset, window_left, window_right, num_heads, group, TILE_D, TILE_D_TAIL, TILE_DV,
                          TILE_DV_TAIL, TILE_M, TILE_N, CAUSAL, EVEN_N, HAS_WINDOW, SOFTCAP, FAST_MATH, LOOP_SPLIT,
                          MASK_BRANCH, K_LATENCY, V_LATENCY, PHASE, DIAGONAL_TILES, DEFER_PV=DEFER_PV)


@ct.kernel
def fmha_varlen(
    Q, K, V, Out, CuSeqlensQ, CuSeqlensK, WorkStarts, WorkItems,
    qk_scale: float,
    window_left: int, window_right: int,
    num_heads: int,
    group: int,
    max_tiles: int,
    TILE_D: ConstInt, TILE_D_TAIL: ConstInt, TILE_DV: ConstInt, TILE_DV_TAIL: ConstInt,
    TILE_M: ConstInt, TILE_N: ConstInt,
    CAUSAL: ConstBool, HAS_WINDOW: ConstBool, SOFTCAP: ConstFloat, FAST_MATH: ConstBool, REVERSE_ORDER: ConstBool,
    K_LATENCY: ConstInt, V_LATENCY: ConstInt, HEAD_GROUP: ConstInt, PERSISTENT: ConstBool, OUT_TMA: ConstBool,
    DIAGONAL_TILES: ConstInt,
):
    """Packed variable-length prefill: the same query-tile work as ``fmha_fwd``, on one sequence of the batch.

    Q, K, V and Out are (1, H, total, D) views of the packed (total, H, D) tensors; sequence b is rows
    ``CuSeqlens[b]:CuSeqlens[b + 1]``. Grid: query tiles of the longest sequence x Hq x B; tiles past a shorter
    sequence's end do nothing. PERSISTENT: one block per SM slot that runs the items the host planned for it
    (``impls._plans.varlen_work_plan``): ``WorkItems[WorkStarts[b]:WorkStarts[b + 1]]``, each item
    ``(sequence * max_tiles + query tile) * num_heads + head``. Otherwise the work arrays are placeholders.

    Q, K and V tiles are read at the sequence's first row plus a row offset (ROW_OFFSETS: a view whose tiles
    step by one row), through the packed tensors' own tensor maps. Rows past the sequence's end belong to the
    next sequence: its keys are masked like the ragged end of a dense Skv (so their values are weighted by
    zero), its queries give output rows that are never stored: only Out is sliced to the sequence, so that
    those rows stay unwritten. Slicing all four arrays instead made every block build four tensor maps at run
    time before its first load (H200, against the dense kernel on an equal-length batch: sliced 0.91-0.98, row
    offsets 0.97-1.0). OUT_TMA: the
    sliced output is stored through TMA, with the one tensor map each block still makes at run time, or, False,
    with bounds-checked plain stores and none (``impls.cutile.serving.varlen_output_store``).

    A sliding window (HAS_WINDOW, bounds ``window_left`` / ``window_right`` in keys) and SOFTCAP apply within each
    sequence, bottom-right like the causal mask, as in ``fmha_fwd``; the host's plan costs a query tile by the key
    tiles its window shows. DIAGONAL_TILES: the causal diagonal (and a window's far edge) peeled as in ``fmha_fwd``,
    where every sequence's keys start a whole number of query tiles' widths before its queries
    (``impls.cutile.serving.varlen_resolved``): a sequence's ragged last query tile needs no more mask than the
    causal one, since no row of the sequence sees a key past its end.
    """
    if PERSISTENT:  # each item read one ahead, as in ``fmha_fwd``'s planned loop
        start = ct.gather(WorkStarts, ct.bid(0)).item()
        item = ct.gather(WorkItems, start).item()  # gathers past the end read 0 (bounds-checked), and go unused
        for i in range(start, ct.gather(WorkStarts, ct.bid(0) + 1).item()):
            upcoming = ct.gather(WorkItems, i + 1).item()
            sequence, tile_m, head = planned_item(item, max_tiles, num_heads)
            attend_sequence_tile(Q, K, V, Out, CuSeqlensQ, CuSeqlensK, sequence, tile_m, head, qk_scale,
                                 window_left, window_right, num_heads, group, TILE_D, TILE_D_TAIL, TILE_DV,
                                 TILE_DV_TAIL, TILE_M, TILE_N, CAUSAL, HAS_WINDOW, SOFTCAP, FAST_MATH, K_LATENCY,
                                 V_LATENCY, True, OUT_TMA, DIAGONAL_TILES)
            item = upcoming
    else:
        num_m = ct.num_blocks(0)
        tile_m, batch_head = work_item(block_item(num_m, num_heads), num_m, ct.num_blocks(2) * num_heads,
                                       CAUSAL and REVERSE_ORDER, HEAD_GROUP)
        attend_sequence_tile(Q, K, V, Out, CuSeqlensQ, CuSeqlensK, batch_head // num_heads, tile_m,
                             batch_head % num_heads, qk_scale, window_left, window_right, num_heads, group, TILE_D,
                             TILE_D_TAIL, TILE_DV, TILE_DV_TAIL, TILE_M, TILE_N, CAUSAL, HAS_WINDOW, SOFTCAP,
                             FAST_MATH, K_LATENCY, V_LATENCY, False, OUT_TMA, DIAGONAL_TILES)


def attend_sequence_tile(Q, K, V, Out, CuSeqlensQ, CuSeqlensK, batch, tile_m, head, qk_scale, window_left,
                         window_right, num_heads, group, TILE_D, TILE_D_TAIL, TILE_DV, TILE_DV_TAIL, TILE_M, TILE_N,
                         CAUSAL, HAS_WINDOW, SOFTCAP, FAST_MATH, K_LATENCY, V_LATENCY, PLANNED, OUT_TMA,
                         DIAGONAL_TILES):
    """Query tile ``tile_m`` of sequence ``batch``, one head, of a packed batch (``fmha_varlen``). PLANNED: the
    host's plan holds only tiles with query rows, so there is no run-time check (inside a persistent loop it
    made the compiler lay the tile's work out twice, sm_90: 96 HGMMA instead of 48, and spill)."""
    q_start = ct.gather(CuSeqlensQ, batch).item()
    q_end = ct.gather(CuSeqlensQ, batch + 1).item()
    k_start = ct.gather(CuSeqlensK, batch).item()
    k_end = ct.gather(CuSeqlensK, batch + 1).item()
    if PLANNED or tile_m * TILE_M < q_end - q_start:
        # batch 0 of the views; no workspace (one launch). EVEN_N (no bound on the key index) where causal: a
        # sequence's query rows see only keys before its end anyway, and the rows past its end are not stored.
        # Without causal the ragged end is masked.
        attend_query_tile(Q, K, V, Out.slice(axis=2, start=q_start, stop=q_end), Q, Q, Q, tile_m, head, qk_scale,
                          (k_end - k_start) - (q_end - q_start), window_left, window_right, num_heads, group, TILE_D,
                          TILE_D_TAIL, TILE_DV, TILE_DV_TAIL, TILE_M, TILE_N, CAUSAL, CAUSAL, HAS_WINDOW, SOFTCAP,
                          FAST_MATH, True, False, K_LATENCY, V_LATENCY, WHOLE, DIAGONAL_TILES, q_row0=q_start,
                          kv_row0=k_start, kv_len=k_end - k_start, ROW_OFFSETS=True, OUT_TMA=OUT_TMA)


def planned_item(item, max_tiles, num_heads):
    """(sequence, query tile, head) of a host plan's item ``(sequence * max_tiles + query tile) * num_heads + head``
    (``impls._plans.WorkPlan``); a dense batch's sequences are its batch entries."""
    rest = item // num_heads
    return rest // max_tiles, rest % max_tiles, item % num_heads


def block_item(num_m, num_heads):
    """The work item of a block of a one-block-per-tile grid (query tiles, heads, batch): its linear index with axis 0
    fastest, as if batch x heads were one axis. They are not, since CUDA caps the second and third axes at 65535."""
    return (ct.bid(2) * num_heads + ct.bid(1)) * num_m + ct.bid(0)


def work_item(linear, num_m, num_bh, HEAVIEST_FIRST, HEAD_GROUP):
    """(query tile, batch * head) of work item ``linear``; items start in order (grid axis 0 fastest).

    HEAVIEST_FIRST (the blog's remap): a causal query tile's work grows with its index, so the last tile of a
    head goes first. With HEAD_GROUP = G > 1 the order is heaviest-first across G heads at a time (every
    head's last tile, then every head's second-to-last, ...), so the light tiles are what is left for the last
    wave; G stays small so that the K/V of the heads in flight still share the L2 cache.
    """
    if HEAVIEST_FIRST and HEAD_GROUP > 1:
        first_head = linear // (HEAD_GROUP * num_m) * HEAD_GROUP
        heads_here = min(HEAD_GROUP, num_bh - first_head)  # the last group may be partial
        rank = linear - first_head * num_m
        tile_m, batch_head = num_m - 1 - rank // heads_here, first_head + rank % heads_here
    elif HEAVIEST_FIRST:
        tile_m, batch_head = num_m - 1 - linear % num_m, linear // num_m
    else:
        tile_m, batch_head = linear % num_m, linear // num_m
    return tile_m, batch_head


def paired_steps(block, num_blocks, num_items):
    """How many items persistent block ``block`` runs in the paired order: both items of pairs ``block``,
    ``block + num_blocks``, ..."""
    num_pairs = ct.cdiv(num_items, 2)
    return 2 * (max(num_pairs - block + num_blocks - 1, 0) // num_blocks)


def paired_linear(step, block, num_blocks, num_items):
    """The item of a block's ``step``: 2p and 2p + 1 of its pair p. With an odd item count the last pair has
    one item, run twice (the same output stored twice)."""
    return min(2 * (block + step // 2 * num_blocks) + step % 2, num_items - 1)


def paired_item(linear, num_m):
    """(query tile, batch * head) of item ``linear`` in the paired order: a head's items alternate between its
    heaviest remaining query tile and the lightest (num_m - 1, 0, num_m - 2, 1, ...), so that items 2p and 2p + 1
    cost about the same as any other such pair. Heads go in order: the pairs running at once share few heads'
    K/V (a head's num_m / 2 pairs are neighbours), as the head groups of ``work_item`` do."""
    rank = linear % num_m
    light = rank % 2  # odd ranks take the light tiles 0, 1, ...; even ones the heavy num_m - 1, num_m - 2, ...
    tile_m = light * (rank // 2) + (1 - light) * (num_m - 1 - rank // 2)
    return tile_m, linear // num_m


def attend_query_tile(Q, K, V, Out, MaxState, SumState, AccState, tile_m, batch_head, qk_scale, causal_offset,
                      window_left, window_right, num_heads, group, TILE_D, TILE_D_TAIL, TILE_DV, TILE_DV_TAIL, TILE_M,
                      TILE_N, CAUSAL, EVEN_N, HAS_WINDOW, SOFTCAP, FAST_MATH, LOOP_SPLIT, MASK_BRANCH, K_LATENCY,
                      V_LATENCY, PHASE, DIAGONAL_TILES=0, q_row0=0, kv_row0=0, kv_len=-1, ROW_OFFSETS=False,
                      OUT_TMA=True, DEFER_PV=False):
    """Output rows ``tile_m`` of one (batch, query head): the whole FlashAttention forward for one Q tile, or
    the masked (DIAGONAL) or mask-free (OFF_DIAGONAL) part of it.

    ROW_OFFSETS (varlen): Q rows start at row ``q_row0`` of Q, K/V rows at ``kv_row0``, and there are ``kv_len``
    keys; otherwise the arrays hold exactly the rows of this work (K.shape[2] keys).

    A head dim runs as a power-of-two tile (TILE_D) and, where it is not one, a narrower tail tile beside it
    (TILE_D_TAIL, columns TILE_D on): Q K^T sums the two products, and P V fills two accumulators, ``acc`` and
    ``acc_tail``. Without a tail, ``acc_tail`` is a placeholder that nothing reads."""
    batch = batch_head // num_heads
    head = batch_head % num_heads
    kv_head = head // group  # GQA by index: K/V are never repeated in memory

    score_scale_log2 = score_scale(qk_scale, SOFTCAP)  # softcap: the tanh per score, SOFTCAP scales after
    offs_m = (tile_m * TILE_M + ct.arange(TILE_M, dtype=ct.int32))[:, None]
    if PHASE == OFF_DIAGONAL:  # resume from where launch 1 left this tile
        m_i, l_i, acc, acc_tail = load_state(MaxState, SumState, AccState, batch, head, tile_m, TILE_M, TILE_DV,
                                             TILE_DV_TAIL)
    else:
        m_i = ct.full((TILE_M, 1), -math.inf, dtype=ct.float32)
        l_i = ct.full((TILE_M, 1), 0.0, dtype=ct.float32)
        acc = zero_accumulator(TILE_M, TILE_DV)
        acc_tail = zero_accumulator(TILE_M, TILE_DV_TAIL)
    # A head dim below TILE_D (+ TILE_D_TAIL) reads zeros past its end: they add nothing to Q K^T, and P V's
    # extra columns are never stored.
    q = load_rows(Q, batch, head, tile_m, TILE_M, TILE_D, 0, None, q_row0, ROW_OFFSETS)
    q_tail = (load_rows(Q, batch, head, tile_m, TILE_M, TILE_D_TAIL, TILE_D, None, q_row0, ROW_OFFSETS)
              if TILE_D_TAIL > 0 else q)

    if not ROW_OFFSETS:
        kv_len = K.shape[2]
    first, free_start, free_end, end = key_tiles(tile_m, kv_len, causal_offset, window_left, window_right,
                                                  TILE_M, TILE_N, CAUSAL, HAS_WINDOW)
    needs_mask = CAUSAL or not EVEN_N or HAS_WINDOW
    if needs_mask and not (LOOP_SPLIT or PHASE != WHOLE):  # the blog's baseline: every tile masked
        free_end = free_start
    # Three runs of key tiles: masked ones at a window's far edge, mask-free ones, masked ones at the causal
    # diagonal, a window's near edge and the ragged end of Skv. The two masked runs share one loop after the
    # mask-free one (the online softmax takes key tiles in any order): a third loop costs the windowed kernel
    # its pipeline depth (sm_90: 128 x 256 tiles spilled with three loops, not with two). DIAGONAL runs only the
    # masked tiles, OFF_DIAGONAL only the mask-free ones; MASK_BRANCH runs the mask-free run and the masked one
    # after it as one loop with a run-time branch.
    if PHASE != DIAGONAL and not MASK_BRANCH:
        if DEFER_PV:
            acc, acc_tail, l_i, m_i = free_tiles_deferred(
                acc, acc_tail, l_i, m_i, q, q_tail, K, V, batch, kv_head, free_start, free_end, kv_len, qk_scale,
                score_scale_log2, TILE_M, TILE_N, TILE_D, TILE_D_TAIL, TILE_DV, TILE_DV_TAIL, SOFTCAP, FAST_MATH,
                K_LATENCY, V_LATENCY)
        else:
            for j in range(free_start, free_end):
                acc, acc_tail, l_i, m_i = attend_key_tile(
                    acc, acc_tail, l_i, m_i, q, q_tail, K, V, batch, kv_head, j, offs_m, qk_scale, score_scale_log2,
                    kv_len, causal_offset, window_left, window_right, TILE_M, TILE_N, TILE_D, TILE_D_TAIL, TILE_DV,
                    TILE_DV_TAIL, MASKED=False, CAUSAL=CAUSAL, EVEN_N=EVEN_N, HAS_WINDOW=HAS_WINDOW,
                    SOFTCAP=SOFTCAP, MAY_BE_EMPTY=False, FAST_MATH=FAST_MATH, K_LATENCY=K_LATENCY,
                    V_LATENCY=V_LATENCY, kv_row0=kv_row0, ROW_OFFSETS=ROW_OFFSETS)
    # The mask-free launch has no masked loop at all, not even an empty one, and neither has a kernel that needs
    # no mask (its mask-free loop ran every tile): a loop the compiler cannot prove empty keeps its pipeline
    # shallow (132 KB instead of 198 on sm_90).
    if DIAGONAL_TILES > 0 and TILE_N > TILE_M:  # peeled at the query tile's width (see ``peel_narrow``)
        acc, acc_tail, l_i, m_i = peel_narrow(
            acc, acc_tail, l_i, m_i, q, q_tail, K, V, batch, kv_head, tile_m, free_start, free_end, offs_m, qk_scale,
            score_scale_log2, kv_len, causal_offset, window_left, window_right, TILE_M, TILE_N, TILE_D, TILE_D_TAIL,
            TILE_DV, TILE_DV_TAIL, EVEN_N, HAS_WINDOW, SOFTCAP, FAST_MATH, K_LATENCY, V_LATENCY, kv_row0, ROW_OFFSETS)
    elif DIAGONAL_TILES > 0:  # peeled: the masked tiles as straight-line code (a static_iter is unrolled), no loop
        for i in ct.static_iter(range(2 * DIAGONAL_TILES if HAS_WINDOW else DIAGONAL_TILES)):
            far = i >= DIAGONAL_TILES  # a window's far-edge tiles, after the diagonal's: any order will do
            j = first + i - DIAGONAL_TILES if far else free_end + i
            # The first window's query tiles have no far edge. No row can be empty here (MAY_BE_EMPTY False):
            # every row sees a key in the first diagonal tile, which comes before any tile where it may see none.
            if not far or first < free_start:
                acc, acc_tail, l_i, m_i = attend_key_tile(
                    acc, acc_tail, l_i, m_i, q, q_tail, K, V, batch, kv_head, j, offs_m, qk_scale,
                    score_scale_log2, kv_len, causal_offset, window_left, window_right, TILE_M, TILE_N, TILE_D,
                    TILE_D_TAIL, TILE_DV, TILE_DV_TAIL, MASKED=True, CAUSAL=CAUSAL, EVEN_N=EVEN_N,
                    HAS_WINDOW=HAS_WINDOW, SOFTCAP=SOFTCAP, MAY_BE_EMPTY=False, FAST_MATH=FAST_MATH,
                    K_LATENCY=K_LATENCY, V_LATENCY=V_LATENCY, kv_row0=kv_row0, ROW_OFFSETS=ROW_OFFSETS)
    elif PHASE != OFF_DIAGONAL and (needs_mask or MASK_BRANCH):
        masked_from = free_start if MASK_BRANCH and PHASE == WHOLE else free_end
        # a window's masked far-edge tiles: the loop's first steps, before masked_from
        far_edge = free_start - first if HAS_WINDOW else 0
        for step in range(masked_from - far_edge, end):
            j = far_edge_or_same(step, masked_from, free_start) if HAS_WINDOW else step
            masked = needs_mask and (not MASK_BRANCH or j >= free_end or j < free_start)
            acc, acc_tail, l_i, m_i = attend_key_tile(
                acc, acc_tail, l_i, m_i, q, q_tail, K, V, batch, kv_head, j, offs_m, qk_scale, score_scale_log2,
                kv_len, causal_offset, window_left, window_right, TILE_M, TILE_N, TILE_D, TILE_D_TAIL, TILE_DV,
                TILE_DV_TAIL, MASKED=masked, CAUSAL=CAUSAL, EVEN_N=EVEN_N, HAS_WINDOW=HAS_WINDOW, SOFTCAP=SOFTCAP,
                MAY_BE_EMPTY=needs_mask, FAST_MATH=FAST_MATH, K_LATENCY=K_LATENCY, V_LATENCY=V_LATENCY,
                kv_row0=kv_row0, ROW_OFFSETS=ROW_OFFSETS)

    if PHASE == DIAGONAL:
        store_state(MaxState, SumState, AccState, m_i, l_i, acc, acc_tail, batch, head, tile_m, TILE_M, TILE_DV,
                    TILE_DV_TAIL)
    else:
        l_i = ct.where(l_i == 0.0, 1.0, l_i)  # rows that saw no key: 0 / 1 = 0
        store_rows(Out, normalised(acc, l_i, FAST_MATH).astype(Out.dtype), batch, head, tile_m, 0, OUT_TMA)
        if TILE_DV_TAIL > 0:
            store_rows(Out, normalised(acc_tail, l_i, FAST_MATH).astype(Out.dtype), batch, head, tile_m, TILE_DV,
                       OUT_TMA)


def peel_narrow(acc, acc_tail, l_i, m_i, q, q_tail, K, V, batch, kv_head, tile_m, free_start, free_end, offs_m,
                qk_scale, score_scale_log2, kv_len, causal_offset, window_left, window_right, TILE_M, TILE_N, TILE_D,
                TILE_D_TAIL, TILE_DV, TILE_DV_TAIL, EVEN_N, HAS_WINDOW, SOFTCAP, FAST_MATH, K_LATENCY, V_LATENCY,
                kv_row0=0, ROW_OFFSETS=False):
    """A causal diagonal peeled where key tiles are wider than query tiles (TILE_N = k * TILE_M, lengths in whole
    tiles): the keys past the mask-free loop run in tiles of TILE_M keys, the query tile's width. Only the last
    of them, its diagonal block, is masked; the up to k - 1 before it, which every row sees whole, run without a
    mask (a run-time ``if`` each), and the keys past the diagonal, which no row sees, are never visited. A
    TILE_N-wide masked tile held twice the score registers and read those keys too: with it peeled, 128 x 256
    tiles spilled 240-256 B on sm_90.

    A window's far edge, before the mask-free loop, runs the same way (``narrow_far_tiles``): its first TILE_M-key
    tile masked, the up to k - 1 after it whole. Masked tiles take the causal and the window mask alike."""
    parts = TILE_N // TILE_M  # TILE_M-key tiles in one key tile of the loop
    diagonal = (tile_m * TILE_M + causal_offset) // TILE_M  # in TILE_M-key tiles; every row sees its first key
    far, far_stop = 0, 0  # a window's far edge: TILE_M-key tiles [far, far_stop)
    if HAS_WINDOW:
        far, far_stop = narrow_far_tiles(tile_m, free_start, causal_offset, window_left, TILE_M, TILE_N)
    for i in ct.static_iter(range(2 * parts if HAS_WINDOW else parts)):
        last = i == parts - 1  # the diagonal block, after the whole ones; then a window's far edge
        j, bound = (far + i - parts, far_stop) if i >= parts else (diagonal if last else free_end * parts + i, diagonal)
        if last or j < bound:  # the diagonal block always (a run-time branch around it costs the pipeline)
            acc, acc_tail, l_i, m_i = attend_key_tile(
                acc, acc_tail, l_i, m_i, q, q_tail, K, V, batch, kv_head, j, offs_m, qk_scale, score_scale_log2,
                kv_len, causal_offset, window_left, window_right, TILE_M, TILE_M, TILE_D, TILE_D_TAIL, TILE_DV,
                TILE_DV_TAIL, MASKED=last or i == parts, CAUSAL=True, EVEN_N=EVEN_N, HAS_WINDOW=HAS_WINDOW,
                SOFTCAP=SOFTCAP, MAY_BE_EMPTY=False, FAST_MATH=FAST_MATH, K_LATENCY=K_LATENCY, V_LATENCY=V_LATENCY,
                kv_row0=kv_row0, ROW_OFFSETS=ROW_OFFSETS)
    return acc, acc_tail, l_i, m_i


def narrow_far_tiles(tile_m, free_start, causal_offset, window_left, TILE_M, TILE_N):
    """A window's far edge for ``peel_narrow``: TILE_M-key tiles ``[far, stop)``, from the first key some row of
    query tile ``tile_m`` sees to the first TILE_N-key tile of the mask-free loop (``free_start``). The first is
    seen in part (masked); the rest are seen whole where the window reaches back at least TILE_N keys
    (``Variant.peel_refusal``). Empty for the first window's query tiles, whose loop starts at key 0."""
    far = max(tile_m * TILE_M + causal_offset - window_left, 0) // TILE_M
    return far, free_start * (TILE_N // TILE_M)


def far_edge_or_same(step, masked_from, free_start):
    """Key tile of a masked loop's ``step``: steps from ``masked_from`` on are tiles of that index; the ones
    before it are the window's far-edge tiles, which end at ``free_start`` (branch-free: the loop's loads are
    issued ahead of time from this index)."""
    before = max(min(masked_from - step, 1), 0)  # 1 for a far-edge step, else 0
    return step + before * (free_start - masked_from)


def key_tiles(tile_m, kv_len, causal_offset, window_left, window_right, TILE_M, TILE_N, CAUSAL, HAS_WINDOW):
    """Key tiles ``[first, end)`` that some row of query tile ``tile_m`` sees (the others are never visited),
    and ``[free_start, free_end)`` within them that every row sees whole (no mask needed there).

    Row i sits at key position i + causal_offset (bottom-right alignment): causal, it sees keys up to its
    position; a window (left, right) keeps keys from position - left to position + right.
    """
    first_row = tile_m * TILE_M + causal_offset  # key positions of the tile's first and last rows
    last_row = first_row + TILE_M - 1
    any_start, all_start = 0, 0  # keys [any_start, any_end) are seen by some row, [all_start, all_end) by all
    any_end, all_end = kv_len, kv_len
    if CAUSAL:
        any_end, all_end = min(any_end, last_row + 1), min(all_end, first_row + 1)
    if HAS_WINDOW:
        any_start, all_start = max(first_row - window_left, 0), max(last_row - window_left, 0)
        any_end, all_end = min(any_end, last_row + window_right + 1), min(all_end, first_row + window_right + 1)
    end = ct.cdiv(max(any_end, 0), TILE_N)
    free_start = min(ct.cdiv(all_start, TILE_N), end)
    free_end = max(min(max(all_end, 0) // TILE_N, end), free_start)  # a ragged last tile (Skv) stays masked
    return any_start // TILE_N, free_start, free_end, end


def attend_key_tile(acc, acc_tail, l_i, m_i, q, q_tail, K, V, batch, kv_head, j, offs_m, qk_scale, score_scale_log2,
                    kv_len, causal_offset, window_left, window_right, TILE_M, TILE_N, TILE_D, TILE_D_TAIL, TILE_DV,
                    TILE_DV_TAIL, MASKED, CAUSAL, EVEN_N, HAS_WINDOW, SOFTCAP, MAY_BE_EMPTY, FAST_MATH, K_LATENCY,
                    V_LATENCY, kv_row0=0, ROW_OFFSETS=False):
    """Fold key tile j into the running state: its scores (capped, then masked where MASKED), the online
    softmax, P V. MAY_BE_EMPTY: a row may have seen no key yet (see ``finite``)."""
    qk = scores(q, q_tail, K, batch, kv_head, j, qk_scale, TILE_M, TILE_N, TILE_D, TILE_D_TAIL, SOFTCAP, FAST_MATH,
                K_LATENCY, kv_row0, ROW_OFFSETS)
    if MASKED:
        qk = mask_scores(qk, offs_m, j, kv_len, causal_offset, window_left, window_right, TILE_N, CAUSAL, EVEN_N,
                         HAS_WINDOW)
    p, alpha, l_i, m_new = softmax_step(qk, l_i, m_i, score_scale_log2, MAY_BE_EMPTY, FAST_MATH)
    p = p.astype(V.dtype)  # tensor cores take P in the input dtype
    acc, acc_tail = values_product(acc * alpha, acc_tail * alpha, p, V, batch, kv_head, j, TILE_M, TILE_N, TILE_DV,
                                   TILE_DV_TAIL, V_LATENCY, kv_row0, ROW_OFFSETS)
    return acc, acc_tail, l_i, m_new


def values_product(acc, acc_tail, p, V, batch, kv_head, j, TILE_M, TILE_N, TILE_DV, TILE_DV_TAIL, V_LATENCY,
                   kv_row0=0, ROW_OFFSETS=False):
    """``acc + P V`` for value tile j (and the tail's accumulator, where V's head dim has a tail)."""
    if one_load(TILE_M, TILE_DV_TAIL):
        values = load_rows(V, batch, kv_head, j, TILE_N, 2 * TILE_DV, 0, V_LATENCY, kv_row0, ROW_OFFSETS)
        v, v_tail = head_and_tail(values, TILE_DV, TILE_DV_TAIL, axis=1)
        acc, acc_tail = ct.mma(p, v, acc), ct.mma(p, v_tail, acc_tail)
    else:
        acc = ct.mma(p, load_rows(V, batch, kv_head, j, TILE_N, TILE_DV, 0, V_LATENCY, kv_row0, ROW_OFFSETS), acc)
        if TILE_DV_TAIL > 0:
            v_tail = load_rows(V, batch, kv_head, j, TILE_N, TILE_DV_TAIL, TILE_DV, V_LATENCY, kv_row0, ROW_OFFSETS)
            acc_tail = ct.mma(p, v_tail, acc_tail)
    return acc, acc_tail


def free_tiles_deferred(acc, acc_tail, l_i, m_i, q, q_tail, K, V, batch, kv_head, free_start, free_end, kv_len,
                        qk_scale, score_scale_log2, TILE_M, TILE_N, TILE_D, TILE_D_TAIL, TILE_DV, TILE_DV_TAIL,
                        SOFTCAP, FAST_MATH, K_LATENCY, V_LATENCY):
    """The mask-free key tiles with each tile's P V deferred to the next step (DEFER_PV): step j issues Q K^T of
    tile j, then P V of tile j - 1 (its P and rescale factor kept from the step before), then tile j's softmax,
    which does not depend on that product, so the compiler runs the two side by side (FlashAttention-3's
    intra-warpgroup overlap; sm_90 SASS: the product's HGMMAs issued between the softmax's exponentials). The last
    tile's P V follows the loop. The first step's P is zeros, times tile ``free_start``, which every row sees
    whole; an empty loop's drain reads the tile just past the keys (zeros in a dense array), so no key that a row
    must not see is multiplied, not even by zero (0 * NaN is NaN). Dense kernel only: in a packed batch the rows
    past a sequence's keys are the next sequence's."""
    p = ct.full((TILE_M, TILE_N), 0.0, dtype=V.dtype)
    alpha = ct.full((TILE_M, 1), 1.0, dtype=ct.float32)
    for j in range(free_start, free_end):
        qk = scores(q, q_tail, K, batch, kv_head, j, qk_scale, TILE_M, TILE_N, TILE_D, TILE_D_TAIL, SOFTCAP,
                    FAST_MATH, K_LATENCY)
        acc, acc_tail = values_product(acc * alpha, acc_tail * alpha, p, V, batch, kv_head, max(j - 1, free_start),
                                       TILE_M, TILE_N, TILE_DV, TILE_DV_TAIL, V_LATENCY)
        p, alpha, l_i, m_i = softmax_step(qk, l_i, m_i, score_scale_log2, False, FAST_MATH)
        p = p.astype(V.dtype)
    empty = max(1 - (free_end - free_start), 0)  # 1 where the loop ran no step
    drain = free_end - 1 + empty * (ct.cdiv(kv_len, TILE_N) + 1 - free_end)  # branch-free (a run-time ``if`` costs
    # the loop its pipeline): the last tile, or where the loop was empty the tile just past the keys
    acc, acc_tail = values_product(acc * alpha, acc_tail * alpha, p, V, batch, kv_head, drain, TILE_M, TILE_N, TILE_DV,
                                   TILE_DV_TAIL, V_LATENCY)
    return acc, acc_tail, l_i, m_i


def load_rows(A, batch, head, row_tile, ROWS, WIDTH, FIRST_COLUMN, LATENCY, row0=0, ROW_OFFSETS=False):
    """Rows ``row_tile`` (tiles of ROWS) of one (batch, head) of a (B, H, S, D) array, columns FIRST_COLUMN to
    FIRST_COLUMN + WIDTH (a multiple of WIDTH: load indices count tiles), as a (ROWS, WIDTH) tile; zeros past
    the array's ends (0 * garbage could be NaN). ROW_OFFSETS: the rows from row ``row0 + row_tile * ROWS``, any
    row, through a view whose tiles step by one row (the tensor map stays the array's)."""
    if ROW_OFFSETS:
        rows = A.tiled_view((1, 1, ROWS, WIDTH), padding_mode=ZERO_PAD, traversal_steps=(1, 1, 1, WIDTH))
        tile = rows.load((batch, head, row0 + row_tile * ROWS, FIRST_COLUMN // WIDTH), latency=LATENCY)
    else:
        tile = ct.load(A, index=(batch, head, row_tile, FIRST_COLUMN // WIDTH), shape=(1, 1, ROWS, WIDTH),
                       latency=LATENCY, padding_mode=ZERO_PAD)
    return tile.reshape((ROWS, WIDTH))


def store_rows(A, tile, batch, head, row_tile, FIRST_COLUMN, TMA=True):
    """The (ROWS, WIDTH) ``tile`` into rows ``row_tile`` of one (batch, head), from column FIRST_COLUMN (a
    multiple of WIDTH); what lies past the array's ends is not stored. TMA False: plain stores, bounds-checked
    element by element (an array sliced at run time then needs no tensor map made at run time)."""
    rows, width = tile.shape
    ct.store(A, index=(batch, head, row_tile, FIRST_COLUMN // width), tile=tile.reshape((1, 1, rows, width)),
             allow_tma=None if TMA else False)


def zero_accumulator(TILE_M, WIDTH):
    """A float32 accumulator of zeros, TILE_M x WIDTH; for a tail of width 0, a one-column placeholder that
    nothing reads."""
    return ct.full((TILE_M, max(WIDTH, 1)), 0.0, dtype=ct.float32)


def normalised(acc, l_i, FAST_MATH):
    if FAST_MATH:
        return ct.truediv(acc, l_i, flush_to_zero=True, rounding_mode=ct.RoundingMode.APPROX)
    return ct.truediv(acc, l_i)


def load_state(MaxState, SumState, AccState, batch, head, tile_m, TILE_M, TILE_DV, TILE_DV_TAIL):
    """The running max, sum and unnormalised accumulator(s) of one query tile, as launch 1 left them. The max and
    the sum come by plain loads: through TMA each consumer warpgroup fetched the whole vector into one shared buffer
    (compute-sanitizer racecheck: a write-after-write of the TMA load with itself)."""
    m_i = ct.load(MaxState, index=(batch, head, tile_m), shape=(1, 1, TILE_M), allow_tma=False).reshape((TILE_M, 1))
    l_i = ct.load(SumState, index=(batch, head, tile_m), shape=(1, 1, TILE_M), allow_tma=False).reshape((TILE_M, 1))
    acc = load_rows(AccState, batch, head, tile_m, TILE_M, TILE_DV, 0, None)
    if TILE_DV_TAIL > 0:
        acc_tail = load_rows(AccState, batch, head, tile_m, TILE_M, TILE_DV_TAIL, TILE_DV, None)
    else:
        acc_tail = zero_accumulator(TILE_M, TILE_DV_TAIL)
    return m_i, l_i, acc, acc_tail


def store_state(MaxState, SumState, AccState, m_i, l_i, acc, acc_tail, batch, head, tile_m, TILE_M, TILE_DV,
                TILE_DV_TAIL):
    ct.store(MaxState, index=(batch, head, tile_m), tile=m_i.reshape((1, 1, TILE_M)))
    ct.store(SumState, index=(batch, head, tile_m), tile=l_i.reshape((1, 1, TILE_M)))
    store_rows(AccState, acc, batch, head, tile_m, 0)
    if TILE_DV_TAIL > 0:
        store_rows(AccState, acc_tail, batch, head, tile_m, TILE_DV)


def scores(q, q_tail, K, batch, kv_head, j, qk_scale, TILE_M, TILE_N, TILE_D, TILE_D_TAIL, SOFTCAP, FAST_MATH,
           K_LATENCY, kv_row0=0, ROW_OFFSETS=False):
    """Q K^T for key tile j, in float32, unscaled (over the tail columns too, where there is a tail); with
    SOFTCAP, tanh(Q K^T * qk_scale / SOFTCAP) (the online softmax multiplies by SOFTCAP)."""
    if one_load(TILE_M, TILE_D_TAIL):
        keys = load_keys(K, batch, kv_head, j, TILE_N, 2 * TILE_D, 0, K_LATENCY, kv_row0, ROW_OFFSETS)
        k, k_tail = head_and_tail(keys, TILE_D, TILE_D_TAIL, axis=0)
        qk = ct.mma(q_tail, k_tail, ct.mma(q, k, ct.full((TILE_M, TILE_N), 0.0, dtype=ct.float32)))
    else:
        qk = ct.mma(q, load_keys(K, batch, kv_head, j, TILE_N, TILE_D, 0, K_LATENCY, kv_row0, ROW_OFFSETS),
                    ct.full((TILE_M, TILE_N), 0.0, dtype=ct.float32))
        if TILE_D_TAIL > 0:
            qk = ct.mma(q_tail, load_keys(K, batch, kv_head, j, TILE_N, TILE_D_TAIL, TILE_D, K_LATENCY, kv_row0,
                                          ROW_OFFSETS), qk)
    return capped(qk, qk_scale, SOFTCAP, FAST_MATH)


def one_load(TILE_M, TAIL):
    """Whether a head dim's tail tile of width TAIL comes from its first tile's load (``head_and_tail``): where the
    tail is ONE_LOAD_TAIL columns or more (Q/K 192 = 128 + 64), in blocks of 128 query rows or more.

    Elsewhere it lost (sm_90, tileiras 13.5): with a tail of 32 the
    16-warp 256x64 (D=96) and the 128x128 at D=160 kept their waits between the products and paid 25-33 KB of shared
    memory; MLA's 64x128 block of one warpgroup went from 128 registers to 255; at D=96 the 8-warp 128-row blocks
    chained their Q K^T but ran 3-27% slower on an H100."""
    return TAIL >= ONE_LOAD_TAIL and TILE_M >= 128


def head_and_tail(tile, WIDTH, TAIL, axis):
    """A tile loaded 2 * WIDTH wide along ``axis`` (the head dim; what lies past it reads zeros), cut into its
    first WIDTH columns and the TAIL columns after them: the operands of a head dim's two matrix products
    (``TILE_D_TAIL``), from one buffer.

    Loaded as two tiles, each has a buffer and a barrier of its own, and the compiler waits for the first product
    to finish (to free its buffer) before it issues the second: the tensor cores drain once more per key tile
    (sm_90 SASS, tileiras 13.5: MLA's Q K^T ran as 8 HGMMAs, a wait, 4 more; cut from one load, the 12 follow each
    other with one wait, +1.7-3.2% on an H100)."""
    other = tile.shape[1 - axis]
    head_shape, tail_shape = ((WIDTH, other), (TAIL, other)) if axis == 0 else ((other, WIDTH), (other, TAIL))
    tail_index = (WIDTH // TAIL, 0) if axis == 0 else (0, WIDTH // TAIL)
    return ct.extract(tile, (0, 0), shape=head_shape), ct.extract(tile, tail_index, shape=tail_shape)


def capped(qk, qk_scale, SOFTCAP, FAST_MATH):
    """Unscaled scores as the online softmax takes them: with SOFTCAP, tanh(qk * qk_scale / SOFTCAP), whose
    scale (SOFTCAP) the softmax multiplies in (``score_scale``); without, unchanged."""
    if SOFTCAP > 0:
        # FAST_MATH: the hardware's tanh (one MUFU op; relative error about 2**-11, so a score capped at 50 moves
        # by at most ~0.025, and a typical one, far below the cap, by much less), as FlashInfer's softcap does.
        # The precise one held Gemma-2's cases at 0.74-0.79 of FlashInfer's (H200).
        mode = ct.RoundingMode.APPROX if FAST_MATH else ct.RoundingMode.FULL
        return ct.tanh(qk * (qk_scale / SOFTCAP), rounding_mode=mode)
    return qk


def score_scale(qk_scale, SOFTCAP):
    """What the online softmax multiplies ``capped`` scores by to have them in log2 units."""
    if SOFTCAP > 0:
        return SOFTCAP * INV_LOG_2
    return qk_scale * INV_LOG_2


def load_keys(K, batch, kv_head, j, TILE_N, WIDTH, FIRST_COLUMN, K_LATENCY, row0=0, ROW_OFFSETS=False):
    """Key tile j, columns FIRST_COLUMN to FIRST_COLUMN + WIDTH, transposed (WIDTH, TILE_N) through the load's
    dimension order, ready to be the right operand of Q K^T (ROW_OFFSETS: as ``load_rows`` reads them, then
    transposed, since a row-stepped view has no dimension order)."""
    if ROW_OFFSETS:
        return ct.transpose(load_rows(K, batch, kv_head, j, TILE_N, WIDTH, FIRST_COLUMN, K_LATENCY, row0, True))
    tile = ct.load(K, index=(batch, kv_head, FIRST_COLUMN // WIDTH, j), shape=(1, 1, WIDTH, TILE_N),
                   order=(0, 1, 3, 2), latency=K_LATENCY, padding_mode=ZERO_PAD)
    return tile.reshape((WIDTH, TILE_N))


def mask_scores(qk, offs_m, j, kv_len, causal_offset, window_left, window_right, TILE_N, CAUSAL, EVEN_N,
                HAS_WINDOW):
    """Scores of keys a row must not see (its future, outside its window, or past the ragged end of Skv)
    become -inf."""
    offs_n = j * TILE_N + ct.arange(TILE_N, dtype=ct.int32)[None, :]
    position = offs_m + causal_offset
    visible = ct.full(qk.shape, True, dtype=ct.bool_)
    if not EVEN_N:
        visible = visible & (offs_n < kv_len)
    if CAUSAL:
        visible = visible & (position >= offs_n)
    if HAS_WINDOW:
        visible = visible & (offs_n >= position - window_left) & (offs_n <= position + window_right)
    return ct.where(visible, qk, -math.inf)


def softmax_step(qk, l_i, m_i, qk_scale_log2, MAY_BE_EMPTY, FAST_MATH, KEY_AXIS=-1):
    """The probabilities ``p`` of a score tile against the new running max, the factor ``alpha`` that rescales
    what was accumulated so far, the new running sum and max (log2 units); P V is the caller's. The keys run
    along KEY_AXIS (0: a tile with a column per query row, as the MLA decode's)."""
    # The tile's row max in log2 units: the scale multiplies the row max once, not the whole tile twice.
    m_tile = ct.max(qk, axis=KEY_AXIS, keepdims=True) * qk_scale_log2
    m_new = ct.maximum(m_i, m_tile)
    m_ref = finite(m_new, MAY_BE_EMPTY)
    alpha = ct.exp2(m_i - m_ref, flush_to_zero=FAST_MATH)  # what was summed so far shrinks by 2**(old - new)
    p = ct.exp2(qk * qk_scale_log2 - m_ref, flush_to_zero=FAST_MATH)
    l_i = l_i * alpha + ct.sum(p, axis=KEY_AXIS, keepdims=True)
    return p, alpha, l_i, m_new


def finite(m, MAY_BE_EMPTY):
    """The reference max with -inf (a row that has seen no key yet, possible only where MAY_BE_EMPTY) replaced
    by 0 wherever it is subtracted: -inf - -inf is NaN."""
    if MAY_BE_EMPTY:
        return ct.where(m == -math.inf, 0.0, m)
    return m


def with_int64_indexing(kernel: ct.kernel, arrays: tuple[str, ...] = ARRAYS) -> ct.kernel:
    """The same kernel with 64-bit shapes, strides and offsets for its ``arrays`` (parameter names).

    cuTile indexes an array in 32 bits unless its parameter is annotated ``ct.IndexedWithInt64``; a tensor of
    2**31 elements or more needs it (the launcher refuses it otherwise: "stride is too big"). The body is
    shared: only the annotations of a copy of the function differ.
    """
    fn = kernel._pyfunc
    wide = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    wide.__qualname__, wide.__module__, wide.__doc__ = fn.__qualname__, fn.__module__, fn.__doc__
    wide.__annotations__ = {**fn.__annotations__, **dict.fromkeys(arrays, ct.IndexedWithInt64)}
    return ct.kernel(wide)


fmha_fwd_int64 = with_int64_indexing(fmha_fwd)
fmha_varlen_int64 = with_int64_indexing(fmha_varlen, ARRAYS[:4])
