"""tools/decode_path.py: it times what it names, one row per kind, and refuses what it cannot time in one line."""
import json

import pytest

from tools.decode_path import KINDS, main, media_part


def test_each_kind_is_one_content_part_of_its_media(tmp_path, capsys):
    out = tmp_path / "rows.json"
    assert main(["--kinds", "jpeg224,gif224x8", "--repeats", "2", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["kind"] for r in rows] == ["jpeg224", "gif224x8"]
    assert all(r["repeats"] == 2 and 0 < r["min_ms"] <= r["median_ms"] for r in rows)
    assert all(r["decode_ms"] > 0 and r["preprocess_ms"] >= 0 for r in rows)
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].split()[:2] == ["kind", "KiB"] and [line.split()[0] for line in printed[1:3]] == [
        "jpeg224", "gif224x8"]
    body = json.loads(media_part("gif224x8"))
    assert body["content"][0]["video_url"]["url"].startswith("data:image/gif;base64,")


def test_an_unknown_kind_is_refused_naming_it(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--kinds", "jpeg224,png1x1"])
    assert exit_.value.code == 2 and "unknown kind 'png1x1'" in capsys.readouterr().err
    assert "png1x1" not in KINDS
