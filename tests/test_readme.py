"""The README's "Use it" example runs as written, on a checkpoint saved by transformers' save_pretrained."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def readme_example(block: int = 0) -> str:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Use it"):]
    section = section[:section.index("\n## ", 1)]
    return re.findall(r"```python\n(.*?)```", section, re.S)[block]


def test_the_readme_example_runs_as_written(tmp_path, tiny_config, monkeypatch, capsys):
    from tests.test_weights import hf_full_model

    code = readme_example()
    assert '"/path/to/GLM-4.1V-9B-Thinking"' in code
    hf_full_model(tiny_config, seed=7).save_pretrained(tmp_path / "ckpt")
    monkeypatch.chdir(ROOT)
    exec(compile(code.replace("/path/to/GLM-4.1V-9B-Thinking", str(tmp_path / "ckpt")), "README.md", "exec"), {})
    shapes = capsys.readouterr().out
    assert "torch.Size([" in shapes and str(tiny_config.out_hidden_size) in shapes


@pytest.mark.parametrize("name", ["GlmVisionEncoder", "EncoderGraphRunner", "BudgetConfig", "process_images",
                                  "process_video"])
def test_the_public_api_fits_on_one_line(name):
    import glmvit

    assert getattr(glmvit, name) is not None and name in glmvit.__all__


def test_the_readme_example_runs_without_a_checkpoint(monkeypatch, capsys):
    """The "Use it" example with its model statement swapped for the random-weight tower the README gives."""
    code = readme_example()
    statement = re.search(r"^model = GlmVisionEncoder\.from_pretrained\(.*?\)\n(?=\S)", code, re.S | re.M)
    assert statement is not None
    monkeypatch.chdir(ROOT)
    swapped = code.replace(statement.group(0), readme_example(1))
    exec(compile(swapped, "README.md", "exec"), {})
    assert "torch.Size([" in capsys.readouterr().out
