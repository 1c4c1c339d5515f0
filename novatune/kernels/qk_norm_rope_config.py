"""Launch configurations of the fused q/k-norm + RoPE kernels (novatune/kernels/qk_norm_rope.py): tile sizes
from the H200 sweep, head blocking, and the per-call heuristics the tune engine may override."""
from __future__ import annotations

import triton

# Elements per work item (padded, both halves): forward (q + k tiles) target and the per-token size beyond which
# heads are split; backward (one tensor's rows); and elements per thread. Set from the H200 sweep at Qwen3-4B's
# shape (bench/bench_qk_norm_rope.py --sweep, Triton 3.6): forward best 2 tokens x 40 heads (10240 elements) on 4
# warps, backward best 32 head rows (4096 elements) on 4 warps. The CPU interpreter runs programs one after another
# at a large fixed cost each, so there tiles are simply made big.
_FWD_TILE, _FWD_MAX_TOKEN_TILE, _FWD_PER_THREAD = 10240, 8192, 64
_BWD_TILE, _BWD_PER_THREAD, _BWD_STAGES = 4096, 32, 3  # per item of one tensor's head rows (qk_norm_rope_bwd_config)
_INTERP_TILE = 65536


# ----------------------------------------------------------------------------------------------- launch configs
def _floor_pow2(x: int) -> int:
    return 1 << (max(1, int(x)).bit_length() - 1)


def _head_blocks(hq: int, hk: int, d: int, split: int) -> tuple[int, int, int, int]:
    """(BLOCK_D, BLOCK_HQ, BLOCK_HK, effective split) for heads split over `split` items per token block."""
    bhq = triton.next_power_of_2(triton.cdiv(hq, split))
    bhk = triton.next_power_of_2(triton.cdiv(hk, split))
    return triton.next_power_of_2(d // 2), bhq, bhk, max(triton.cdiv(hq, bhq), triton.cdiv(hk, bhk))


def qk_norm_rope_fwd_config(n_tok: int, hq: int, hk: int, d: int, on_gpu: bool = True, sms: int = 132) -> dict:
    """Default forward launch config: dict(block_t, split, num_warps); one program per work item.

    ~10240 elements per item, 64 per thread, from the H200 sweep at Qwen3-4B's shape (Triton 3.6; 32 + 8 heads x
    128, 4096 tokens): best 2 tokens x all heads on 4 warps, 25.9 us (ptxas for sm_90: 168 registers, no spills,
    3 programs per SM), vs 28.9 us for the former 1 token on 8 warps (78 registers). Heads are split only when one
    token's tile passes 8192 elements (e.g. 64 + 8 heads x 128), several tokens per item when heads are few, but not
    so many that short inputs leave SMs idle. Only the Qwen3-4B point is measured; other shapes extrapolate."""
    split = 1
    if on_gpu:
        while split < max(hq, hk) and _item_elems(hq, hk, d, split) > _FWD_MAX_TOKEN_TILE:
            split *= 2
    block_d, bhq, bhk, split = _head_blocks(hq, hk, d, split)
    per_tok = (bhq + bhk) * 2 * block_d
    block_t = min(_floor_pow2(max(1, (_FWD_TILE if on_gpu else _INTERP_TILE) // per_tok)),
                  triton.next_power_of_2(max(n_tok, 1)))
    while on_gpu and block_t > 1 and triton.cdiv(n_tok, block_t) * split < 2 * sms:
        block_t //= 2  # short inputs: more, smaller items before fewer, bigger ones
    return {"block_t": block_t, "split": split,
            "num_warps": max(4, min(16, _floor_pow2(block_t * per_tok // (32 * _FWD_PER_THREAD))))}


def _item_elems(hq, hk, d, split):
    block_d, bhq, bhk, _ = _head_blocks(hq, hk, d, split)
    return (bhq + bhk) * 2 * block_d


def qk_norm_rope_bwd_config(n_tok: int, hq: int, hk: int, d: int, on_gpu: bool = True) -> dict:
    """Default backward config: dict(rows, num_warps, stages) (num_programs comes from the launcher).

    The backward runs q and k as two phases of one persistent launch, each over items of `rows` head rows of one
    tensor. From the H200 sweep at Qwen3-4B's shape (bench/bench_qk_norm_rope.py --sweep, Triton 3.6; rows 4..32 x
    warps 2..16 x stages {0, 1, 3}): best 4096 elements per item (rows = 32 at d = 128: q -> 1 token x 32 heads,
    k -> 4 tokens x 8 heads) on 4 warps (32 elements per thread) through the cp.async pipeliner with 3 stages,
    39.6 us, vs 45.2 us for the former rows 8 / 4 warps / register prefetch (stages 0). ptxas for sm_90: 231
    registers, no spills, 37 KB shared memory, 2 programs (8 warps) per SM; the launcher sizes the grid from the
    measured residency. Every warp holds whole head rows (row reductions stay in the warp). n_tok, hq, hk are
    accepted for symmetry with the forward (unused)."""
    del n_tok, hq, hk
    block_d = triton.next_power_of_2(d // 2)
    rows = max(1, (_BWD_TILE if on_gpu else _INTERP_TILE) // (2 * block_d))
    return {"rows": rows, "num_warps": max(4, min(16, _floor_pow2(rows * 2 * block_d // (32 * _BWD_PER_THREAD)))),
            "stages": _BWD_STAGES}


def _rows_tile(h: int, rows: int, n_tok: int) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_H, SPLIT) of items of ~`rows` head rows for a tensor with h heads."""
    bh = min(triton.next_power_of_2(h), triton.next_power_of_2(rows))
    split = triton.cdiv(h, bh)
    bt = min(max(1, triton.next_power_of_2(rows) // bh), triton.next_power_of_2(max(n_tok, 1)))
    return bt, bh, split
