"""Provenance of recorded results: the commit comes from git, or from GLMVIT_GIT_COMMIT where there is no git."""
import glmvit.provenance as provenance


def test_commit_from_git_in_a_checkout(monkeypatch, tmp_path):
    """A fresh repository with one commit: git_state names that commit, and sees a tracked edit as dirty."""
    import subprocess

    monkeypatch.delenv(provenance.COMMIT_ENV, raising=False)
    run = lambda *args: subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True,  # noqa: E731
                                       text=True).stdout.strip()
    run("init", "-q")
    (tmp_path / "f.txt").write_text("a")
    run("add", "f.txt")
    run("-c", "user.email=t@t", "-c", "user.name=t", "commit", "-q", "-m", "one")
    monkeypatch.setattr(provenance, "REPO", str(tmp_path))
    assert provenance.git_state() == {"git_commit": run("rev-parse", "HEAD"), "git_dirty": False,
                                      "commit_source": "git"}
    (tmp_path / "f.txt").write_text("b")
    assert provenance.git_state()["git_dirty"] is True


def test_the_environment_names_the_commit_and_wins_over_git(monkeypatch, tmp_path):
    monkeypatch.setenv(provenance.COMMIT_ENV, "0123456789abcdef")  # e.g. a copied tree with a stale .git
    expected = {"git_commit": "0123456789abcdef", "git_dirty": None, "commit_source": provenance.COMMIT_ENV}
    assert provenance.git_state() == expected
    monkeypatch.setattr(provenance, "REPO", str(tmp_path))  # not a git checkout
    assert provenance.git_state() == expected
    monkeypatch.delenv(provenance.COMMIT_ENV)
    assert provenance.git_state() == {"git_commit": None, "git_dirty": None, "commit_source": None}
