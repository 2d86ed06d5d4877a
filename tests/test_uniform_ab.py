"""tools/uniform_ab.py on the CPU: a dry run of the whole A/B on the tiny config, every batch of equal segments
replayed through a uniform graph and agreeing with the default graph."""
import json

from tools import uniform_ab


def test_uniform_lengths_are_the_layouts_frame_sizes():
    assert uniform_ab.segment_lengths({"a": [[1, 16, 16], [4, 32, 32]], "b": [[2, 16, 16]]}) == (256, 1024)


def test_the_ab_replays_equal_segments_through_uniform_graphs_with_the_same_outputs(tmp_path):
    out = tmp_path / "ab.json"
    assert uniform_ab.main(["--device", "cpu", "--config", "tiny", "--modes", "graph", "--runs", "2",
                            "--layouts", "1x224,4x224", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["results"]) == {"graph 1x224", "graph 4x224"}
    for row in result["results"].values():
        assert row["replays"] > 0 and row["uniform_replays"] == row["replays"]
        assert row["plain_ms"] > 0 and row["uniform_ms"] > 0
        # float32 on the CPU: the dense SDPA and the per-segment attention sum in different orders at most, ~1e-6 of
        # outputs of order one (a random tiny tower's), far below 1e-4
        assert row["max_abs_diff"] < 1e-4
    assert result["provenance"]["command"].startswith("python")
