"""Models by hub id, from the local Hugging Face cache only: pagedkv never downloads.

The cache layout is huggingface_hub's: ``<HF_HUB_CACHE>/models--org--name/`` holds
``refs/<branch>`` (a commit hash) and ``snapshots/<commit>/`` (the files). A user who
names ``org/name`` expects what ``from_pretrained("org/name")`` would load offline:
the snapshot ``refs/main`` points at, or the one revision they ask for.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from pagedkv.core.errors import ConfigError

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


def looks_like_hub_id(model: str) -> bool:
    """``org/name`` that is not an existing local path."""
    return bool(_HUB_ID.match(model)) and not Path(model).expanduser().exists()


def hub_cache_dir() -> Path:
    """Where huggingface_hub keeps models: HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return Path(home).expanduser() / "hub"


def resolve_cached_model(repo_id: str, revision: str | None = None) -> Path:
    """The snapshot directory of ``repo_id`` at ``revision`` (a branch, tag or commit) in the local cache."""
    repo_dir = hub_cache_dir() / f"models--{repo_id.replace('/', '--')}"
    how_to_get = (
        f"download it once where there is network (`huggingface-cli download {repo_id}` or "
        f"`from_pretrained('{repo_id}')`), copy the cache to {hub_cache_dir()} (or set HF_HUB_CACHE / HF_HOME), "
        "or pass --model PATH to a local model directory"
    )
    snapshots_dir = repo_dir / "snapshots"
    snapshots = sorted(p.name for p in snapshots_dir.iterdir() if p.is_dir()) if snapshots_dir.is_dir() else []
    if not snapshots:
        raise ConfigError(f"model {repo_id!r} is not in the local Hugging Face cache; {how_to_get}")
    wanted = revision or "main"
    ref = repo_dir / "refs" / wanted
    if ref.is_file():
        commit = ref.read_text().strip()
    elif wanted in snapshots or (revision and len(revision) >= 7 and _unique_prefix(revision, snapshots)):
        commit = wanted if wanted in snapshots else _unique_prefix(wanted, snapshots)
    elif revision is None and len(snapshots) == 1:
        commit = snapshots[0]
    elif revision is None:
        raise ConfigError(
            f"the cache holds {len(snapshots)} revisions of {repo_id!r} and none is 'main'; choose one with "
            f"--revision ({', '.join(s[:12] for s in snapshots)})"
        )
    else:
        refs = sorted(p.name for p in (repo_dir / "refs").iterdir()) if (repo_dir / "refs").is_dir() else []
        raise ConfigError(
            f"revision {revision!r} of {repo_id!r} is not in the local cache (cached: "
            f"{', '.join([*refs, *(s[:12] for s in snapshots)])}); {how_to_get}"
        )
    path = snapshots_dir / commit
    if not (path / "config.json").is_file():
        raise ConfigError(f"the cached snapshot {path} of {repo_id!r} has no config.json (incomplete download?)")
    return path


def _unique_prefix(prefix: str, names: list[str]) -> str | None:
    hits = [n for n in names if n.startswith(prefix)]
    return hits[0] if len(hits) == 1 else None
