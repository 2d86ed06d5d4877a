"""tools/attention_sweep.py on the CPU: it refuses in one line without CUDA, and its layouts are the graphs' layouts."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from glmvit.metadata import BatchShape, build_metadata
from tools.attention_sweep import build_layout

ROOT = Path(__file__).resolve().parents[1]


def test_refuses_without_cuda_in_one_line():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run([sys.executable, "tools/attention_sweep.py", "--json", os.devnull], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert run.stdout == ""
    assert len(run.stderr.strip().splitlines()) == 1 and "CUDA" in run.stderr


def test_layout_matches_the_graphs_metadata():
    """Four 224² images: the sweep's cu_seqlens and segment ids are what build_metadata packs for the budget shape
    ``EncoderGraphRunner.batch_shape`` gives them (rows = max_seqlen = 4 · tokens, min(64, tokens) slots)."""
    layout = build_layout((256,) * 4)
    tokens = 256
    shape = BatchShape(rows=4 * tokens, segments=min(64, tokens), max_seqlen=4 * tokens)
    host = build_metadata([[1, 16, 16]] * 4, 2, shape)
    assert layout.rows == shape.rows == 1024
    np.testing.assert_array_equal(layout.cu_seqlens, host.cu_seqlens)
    np.testing.assert_array_equal(layout.segment_ids, host.to("cpu").segment_ids.numpy())
    assert layout.max_seqlen == 256


def test_layout_pads_a_long_segment_and_bounds_it_by_its_length():
    layout = build_layout((5329,))
    assert layout.rows == 5332  # 1333 tokens
    assert len(layout.cu_seqlens) == BatchShape(5332, 64, 5332).cu_slots
    assert layout.cu_seqlens.dtype == np.int32
    assert layout.cu_seqlens[0] == 0 and (layout.cu_seqlens[1:] == 5329).all()  # unused slots are empty
    assert layout.max_seqlen == 5329
    assert layout.segment_ids[5328] == 0 and list(layout.segment_ids[5329:]) == [1, 2, 3]
    assert len(layout.h_idx) == len(layout.w_idx) == 5332


def test_layout_of_eight_448_images():
    layout = build_layout((1024,) * 8)
    assert (layout.rows, layout.max_seqlen, layout.real_rows) == (8192, 1024, 8192)
    assert list(layout.cu_seqlens[:9]) == [1024 * i for i in range(9)]
    assert (layout.cu_seqlens[9:] == 8192).all()


def test_layout_refuses_more_segments_than_slots():
    with pytest.raises(ValueError, match="segments exceed"):
        build_layout((4,) * 65)


def test_sweep_times_each_tma_configuration_under_its_name():
    """One ``triton_tma@<name>`` path per configuration of the Hopper-shaped kernel (built here, not run)."""
    pytest.importorskip("triton")
    from glmvit.kernels.triton_attention_tma import SWEEP_CONFIGS
    from tools.attention_sweep import tma_paths

    names = list(tma_paths(None, None, None, None))
    assert names == [f"triton_tma@{config.name}" for config in SWEEP_CONFIGS]


def test_tma_ab_refuses_without_cuda_in_one_line():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run([sys.executable, "tools/tma_ab.py", "--json", os.devnull], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert run.stdout == ""
    assert len(run.stderr.strip().splitlines()) == 1 and "CUDA" in run.stderr


def test_the_record_names_each_attention_library_s_version_or_none():
    from glmvit.kernels.fa4_attention import installed
    from tools.attention_sweep import LIBRARIES, library_versions

    versions = library_versions()
    assert list(versions) == list(LIBRARIES)
    assert all(v is None or (isinstance(v, str) and v[0].isdigit()) for v in versions.values())
    assert (versions["flash-attn-4"] is not None) == installed()  # the package that imports is the one named
