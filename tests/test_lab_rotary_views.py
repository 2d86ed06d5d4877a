"""glmvit.lab.rotary_views: notebook 01's timer, token-order and rotary pictures, distinct-value counts."""
from __future__ import annotations

import time

import matplotlib
import numpy as np
import pytest

from glmvit.lab.rotary_views import best_time, distinct_per_column, plot_distinct, plot_rotary, plot_token_order
from glmvit.rotary import rot_pos_ids

matplotlib.use("Agg")


def test_best_time_is_per_call_and_refuses_zero_calls():
    assert 0.002 <= best_time(lambda: time.sleep(0.002), number=3, repeat=2) < 0.05
    assert best_time(lambda: None, number=10) < best_time(lambda: time.sleep(0.001), number=2)
    with pytest.raises(ValueError, match="positive"):
        best_time(lambda: None, number=0)


def test_token_order_draws_every_token_at_its_patch():
    ids = rot_pos_ids(4, 6)
    fig = plot_token_order(ids[:, 0], ids[:, 1], 4, 6)
    ax = fig.axes[0]
    texts = {t.get_text(): t.get_position() for t in ax.texts if t.get_text()}  # arrows are empty annotations
    assert len(texts) == 24 and texts["5"] == (ids[5, 1], ids[5, 0] + 0.3)
    image = ax.images[0].get_array()
    assert image[ids[7, 0], ids[7, 1]] == 1  # token 7 belongs to the second merge block
    with pytest.raises(ValueError, match="24 ids"):
        plot_token_order(ids[:5, 0], ids[:5, 1], 4, 6)


def test_rotary_picture_labels_its_bands():
    fig = plot_rotary(np.zeros((10, 8)))
    assert [t.get_text() for t in fig.axes[0].texts] == ["h", "w", "h", "w"]
    assert fig.axes[0].images[0].get_array().shape == (8, 10)  # head dimensions down
    with pytest.raises(ValueError, match="bands"):
        plot_rotary(np.zeros((10, 6)))


def test_distinct_per_column_counts_each_column():
    assert distinct_per_column(np.array([[1, 5], [1, 6], [2, 6]])) == [2, 2]
    with pytest.raises(ValueError, match="2-D"):
        distinct_per_column(np.zeros(3))
    fig = plot_distinct({"a": [1, 2], "b": [3, 4]}, "t")
    assert [line.get_label() for line in fig.axes[0].lines] == ["a", "b"]
