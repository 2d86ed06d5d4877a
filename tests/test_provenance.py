"""Provenance of recorded results: the commit comes from git, or from GLMVIT_GIT_COMMIT where there is no git."""
import glmvit.provenance as provenance


def test_commit_from_git_in_this_checkout():
    state = provenance.git_state()
    if state["commit_source"] == "git":
        assert len(state["git_commit"]) == 40 and isinstance(state["git_dirty"], bool)


def test_commit_from_the_environment_without_git(monkeypatch, tmp_path):
    monkeypatch.setattr(provenance, "REPO", str(tmp_path))  # not a git checkout
    monkeypatch.setenv(provenance.COMMIT_ENV, "0123456789abcdef")
    assert provenance.git_state() == {"git_commit": "0123456789abcdef", "git_dirty": None,
                                      "commit_source": provenance.COMMIT_ENV}
    monkeypatch.delenv(provenance.COMMIT_ENV)
    assert provenance.git_state() == {"git_commit": None, "git_dirty": None, "commit_source": None}
