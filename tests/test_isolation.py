"""Item isolation on CPU: NaN/Inf pixels are reported by item."""
import numpy as np
import pytest

from glmvit.metadata import nonfinite_items
from glmvit.testing import random_batch

GRIDS = [[1, 4, 6], [2, 2, 4], [1, 6, 2], [1, 2, 2]]  # an image, a 2-frame clip, two more images
HUGE = 3e38  # finite, so the host check lets it through; a patch row of it overflows to Inf inside the tower


def item_spans(grids, merge_area=4):
    """(row range, token range) of every item in a packed batch."""
    rows = np.cumsum([0] + [t * h * w for t, h, w in grids])
    return [((a, b), (a // merge_area, b // merge_area)) for a, b in zip(rows[:-1], rows[1:], strict=True)]


def poison(pixels, grids, item, kind):
    """A copy of ``pixels`` with item ``item`` poisoned: one NaN or +Inf pixel, or one patch row all HUGE."""
    out = pixels.clone()
    (a, b), _ = item_spans(grids)[item]
    if kind == "huge":
        out[(a + b) // 2] = HUGE
    else:
        out[(a + b) // 2, 7] = float(kind)
    return out


def test_nonfinite_pixels_are_named_by_item(tiny_model, tiny_config):
    pixels, grid = random_batch(GRIDS, tiny_config, seed=24)
    bad = poison(poison(pixels, GRIDS, 1, "nan"), GRIDS, 3, "inf")
    bad[0] = HUGE  # item 0: finite rows whose sum overflows are suspects, then cleared value by value
    bad[2, 0] = -float("inf")  # item 0 again, as -Inf
    assert nonfinite_items(bad, np.array(GRIDS)) == [0, 1, 3]
    assert nonfinite_items(bad.bfloat16(), np.array(GRIDS)) == [0, 1, 3]
    bad[2, 0] = 0
    assert nonfinite_items(bad, np.array(GRIDS)) == [1, 3]
    with pytest.raises(ValueError, match=r"^pixel_values of item\(s\) \[1, 3\] hold NaN or Inf[^\n]*$"):
        tiny_model(bad, grid)
    assert tiny_model(bad, grid, check_finite=False).shape[0] == pixels.shape[0] // 4
    assert nonfinite_items(pixels[:0], np.zeros((0, 3), np.int64)) == []
