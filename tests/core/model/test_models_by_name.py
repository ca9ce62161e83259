"""Hub ids resolve from the local Hugging Face cache only, never the network."""

from __future__ import annotations

import pytest

from pagedkv.core.errors import ConfigError
from pagedkv.core.model.model_loader import resolve_model_dir


def _snapshot(cache, repo_id, commit, ref=None):
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    if ref:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snap


@pytest.fixture
def hub(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path


def test_hub_id_resolves_to_the_snapshot_main_points_at(hub):
    _snapshot(hub, "org/model", "a" * 40)
    main = _snapshot(hub, "org/model", "b" * 40, ref="main")
    assert resolve_model_dir("org/model") == main


def test_revision_picks_a_branch_a_commit_or_its_prefix(hub):
    old = _snapshot(hub, "org/model", "a" * 40, ref="v1")
    new = _snapshot(hub, "org/model", "b" * 40, ref="main")
    assert resolve_model_dir("org/model", revision="v1") == old
    assert resolve_model_dir("org/model", revision="b" * 40) == new
    assert resolve_model_dir("org/model", revision="aaaaaaa") == old
    with pytest.raises(ConfigError, match="revision 'v2'.*not in the local cache"):
        resolve_model_dir("org/model", revision="v2")


def test_several_revisions_without_main_ask_for_one(hub):
    _snapshot(hub, "org/model", "a" * 40)
    _snapshot(hub, "org/model", "b" * 40)
    with pytest.raises(ConfigError, match="--revision"):
        resolve_model_dir("org/model")


def test_hf_home_is_honoured_when_hub_cache_is_unset(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    snap = _snapshot(tmp_path / "hub", "org/model", "c" * 40, ref="main")
    assert resolve_model_dir("org/model") == snap


def test_uncached_hub_id_says_how_to_get_it(hub):
    with pytest.raises(ConfigError, match="not in the local Hugging Face cache.*download it once"):
        resolve_model_dir("someone/absent-model")


def test_revision_on_a_local_directory_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="--revision applies to hub ids"):
        resolve_model_dir(str(tmp_path), revision="main")
