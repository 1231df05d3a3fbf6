"""A tiny random model written into a Hugging Face hub cache's layout, so that MODEL can be
a hub id without a network: `models--org--name/refs/main` holds the commit and
`models--org--name/snapshots/<commit>/` the files (regular files; the cache's own blobs and
links are not needed to read it)."""
from __future__ import annotations

import os

from tests.support.tiny_models import make_tiny_model, save_tiny_tokenizer

COMMIT = "0123456789abcdef0123456789abcdef01234567"  # a commit hash's shape: 40 hex digits


def write_snapshot(cache, repo_id: str, arch: str = "qwen2", commit: str = COMMIT,
                   branch: str = "main", weights: bool = True) -> str:
    """A tiny `arch` model and its word-level tokenizer as `repo_id`'s snapshot `commit` in
    the hub cache `cache`, `branch` pointing at it; returns the snapshot directory.
    weights=False leaves the safetensors out (a repository without them)."""
    repo = os.path.join(str(cache), "models--" + repo_id.replace("/", "--"))
    path = os.path.join(repo, "snapshots", commit)
    make_tiny_model(path, arch)
    save_tiny_tokenizer(path)
    if not weights:
        for name in os.listdir(path):
            if name.endswith(".safetensors"):
                os.remove(os.path.join(path, name))
    os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
    with open(os.path.join(repo, "refs", branch), "w") as f:
        f.write(commit)
    return path
