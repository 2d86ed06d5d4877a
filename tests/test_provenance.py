"""Provenance of recorded results: the commit comes from git, or from GLMVIT_GIT_COMMIT where there is no git."""
import glmvit.provenance as provenance


def test_commit_from_git_in_this_checkout(monkeypatch):
    monkeypatch.delenv(provenance.COMMIT_ENV, raising=False)
    state = provenance.git_state()
    if state["commit_source"] == "git":
        assert len(state["git_commit"]) == 40 and isinstance(state["git_dirty"], bool)


def test_the_environment_names_the_commit_and_wins_over_git(monkeypatch, tmp_path):
    monkeypatch.setenv(provenance.COMMIT_ENV, "0123456789abcdef")  # e.g. a copied tree with a stale .git
    expected = {"git_commit": "0123456789abcdef", "git_dirty": None, "commit_source": provenance.COMMIT_ENV}
    assert provenance.git_state() == expected
    monkeypatch.setattr(provenance, "REPO", str(tmp_path))  # not a git checkout
    assert provenance.git_state() == expected
    monkeypatch.delenv(provenance.COMMIT_ENV)
    assert provenance.git_state() == {"git_commit": None, "git_dirty": None, "commit_source": None}
