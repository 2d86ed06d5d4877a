"""The grouped order of a matmul's output tiles (Triton's matmul tutorial 03), shared by the fused GEMMs: GROUP_M row
tiles walk the column tiles together, so the weight tiles they share stay in L2."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def grouped_tile(pid, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    """Tile number ``pid`` of a ``tiles_m`` × ``tiles_n`` grid in grouped order: its (row tile, column tile)."""
    in_group = GROUP_M * tiles_n
    first_m = (pid // in_group) * GROUP_M
    group_size = tl.minimum(tiles_m - first_m, GROUP_M)
    return first_m + (pid % in_group) % group_size, (pid % in_group) // group_size
