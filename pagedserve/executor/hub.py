"""Models from the Hugging Face hub: a hub id (`org/name`) to a snapshot directory in
huggingface_hub's cache.

`snapshot(repo_id, revision)` downloads only what the executor loads (the safetensors
the index names, else those at the repository's root, and the config and tokenizer
files of TOKENIZER_FILES), with huggingface_hub's progress bars; its cache (HF_HOME,
HF_HUB_CACHE), HF_TOKEN and HF_ENDPOINT are huggingface_hub's own. With HF_HUB_OFFLINE=1,
or when the hub cannot be reached, the cached snapshot is used. Every failure is a
ModelLoadError saying what was tried and what to do (`explain`).
"""
from __future__ import annotations

import json
import logging
import os
import re

from pagedserve.executor.errors import ModelLoadError

INDEX = "model.safetensors.index.json"
# the files the executor reads (config, generation config) or hands the gateway's tokenizer
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "chat_template.jinja", "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt",
    "vocab.txt", "config.json", "generation_config.json",
)
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
SNAPSHOT = re.compile(r"models--(?P<org>[^/]+?)(--(?P<name>[^/]+))?/snapshots/[^/]+/?$")
NETWORK_ERRORS = ("TransportError", "ConnectionError", "Timeout", "TimeoutException")
log = logging.getLogger("pagedserve.executor")


def looks_like_hub_id(model: str) -> bool:
    """`org/name` or `name`, not a path (./x, /x, ~/x) nor a .gguf file."""
    return bool(HUB_ID.fullmatch(model)) and not model.endswith(".gguf") and ".." not in model


def repo_of_snapshot(path: str) -> str | None:
    """The hub id of a directory in the hub cache's layout (models--org--name/snapshots/<commit>)."""
    m = SNAPSHOT.search(os.path.abspath(path))
    if m is None:
        return None
    return f"{m['org']}/{m['name']}" if m["name"] else m["org"]


def snapshot(repo_id: str, revision: str | None = None, progress: bool = True) -> str:
    """The directory of `repo_id` at `revision` (default: main) in the hub cache, downloaded
    when missing or stale; ModelLoadError otherwise."""
    from huggingface_hub import constants, errors, snapshot_download

    bars = {} if progress else {"tqdm_class": _silent_tqdm()}
    if constants.HF_HUB_OFFLINE:
        path = _cached(repo_id, revision)
        if path is None:
            raise ModelLoadError(
                f"{repo_id}{_at(revision)}: not in the Hugging Face cache ({constants.HF_HUB_CACHE}) "
                f"and HF_HUB_OFFLINE=1 forbids downloading it: unset HF_HUB_OFFLINE to download it, "
                f"or download it where there is a network (`hf download {repo_id}`) into this "
                f"cache (HF_HOME or HF_HUB_CACHE), or pass a local model directory")
        return _checked(repo_id, path)
    try:
        wanted = files_to_load(repo_id, revision)
        path = snapshot_download(repo_id, revision=revision, allow_patterns=wanted, **bars)
    except errors.HfHubHTTPError as e:
        raise explain(e, repo_id, revision) from e
    except ModelLoadError:
        raise
    except Exception as e:
        if not unreachable(e):
            raise ModelLoadError(f"{repo_id}{_at(revision)}: the download failed "
                                 f"({type(e).__name__}: {e})") from e
        path = _cached(repo_id, revision)
        if path is None:
            raise ModelLoadError(
                f"{repo_id}{_at(revision)}: could not reach {constants.ENDPOINT} to download it "
                f"({type(e).__name__}: {e}) and it is not in the Hugging Face cache "
                f"({constants.HF_HUB_CACHE}): check the network (or HF_ENDPOINT), or copy the "
                f"model to this machine and pass its directory") from e
        log.warning("%s unreachable (%s): serving the cached snapshot %s (HF_HUB_OFFLINE=1 "
                    "skips the hub)", constants.ENDPOINT, type(e).__name__, path)
    return _checked(repo_id, path)


def unreachable(e: Exception) -> bool:
    """`e` says the hub could not be reached: a connection error or a timeout, of the HTTP
    client huggingface_hub uses (httpx, requests) or of the standard library."""
    from huggingface_hub import errors

    return isinstance(e, (ConnectionError, TimeoutError, errors.LocalEntryNotFoundError)) or any(
        c.__name__ in NETWORK_ERRORS for c in type(e).__mro__)


def config_file(repo_id: str, revision: str | None = None) -> str:
    """The repository's config.json alone (what `pagedserve advise` reads), from the cache or
    downloaded; ModelLoadError otherwise."""
    from huggingface_hub import constants, errors, hf_hub_download

    try:
        return hf_hub_download(repo_id, "config.json", revision=revision)
    except errors.HfHubHTTPError as e:
        raise explain(e, repo_id, revision) from e
    except errors.LocalEntryNotFoundError as e:
        why = ("HF_HUB_OFFLINE=1 forbids downloading it" if constants.HF_HUB_OFFLINE
               else f"{constants.ENDPOINT} could not be reached")
        raise ModelLoadError(f"{repo_id}{_at(revision)}: its config.json is not in the Hugging Face "
                             f"cache ({constants.HF_HUB_CACHE}) and {why}") from e


def files_to_load(repo_id: str, revision: str | None) -> list[str]:
    """The repository's files the executor reads: its safetensors (the index's shards, else
    those at the root), config and tokenizer files. ModelLoadError when it has no safetensors."""
    from huggingface_hub import HfApi, hf_hub_download

    files = HfApi().list_repo_files(repo_id, revision=revision)
    if INDEX in files:
        with open(hf_hub_download(repo_id, INDEX, revision=revision)) as f:
            weights = sorted(set(json.load(f)["weight_map"].values())) + [INDEX]
    else:
        weights = [f for f in files if f.endswith(".safetensors") and "/" not in f]
    if not weights:
        raise ModelLoadError(_no_safetensors(repo_id, files))
    return weights + [f for f in TOKENIZER_FILES if f in files]


def explain(e: Exception, repo_id: str, revision: str | None) -> ModelLoadError:
    """The hub's refusal `e` as what the user can do about it."""
    from huggingface_hub import constants, errors, get_token

    url = f"{constants.ENDPOINT}/{repo_id}"
    token = get_token()
    if isinstance(e, errors.GatedRepoError):
        if token:
            return ModelLoadError(
                f"{repo_id} is a gated model and the token in use (HF_TOKEN, or the one `hf auth "
                f"login` saved) has no access to it: accept its terms at {url} with that token's "
                f"account")
        return ModelLoadError(f"{repo_id} is a gated model: accept its terms at {url}, then set "
                              f"HF_TOKEN to a token of that account (or run `hf auth login`)")
    if isinstance(e, errors.RevisionNotFoundError):
        return ModelLoadError(f"{repo_id} has no revision {revision!r}: --revision takes a branch, "
                              f"tag or commit of {url}")
    if isinstance(e, errors.RepositoryNotFoundError):
        return ModelLoadError(
            f"{repo_id}: no local directory or .gguf file by that name, and no model at {url}"
            + ("" if token else " (if it is private, set HF_TOKEN to a token with access)"))
    status = getattr(getattr(e, "response", None), "status_code", None)
    if status in (401, 403):
        return ModelLoadError(f"{repo_id}: {constants.ENDPOINT} refused the download ({status}): "
                              f"set HF_TOKEN to a token with access to {url}")
    return ModelLoadError(f"{repo_id}{_at(revision)}: the download from {constants.ENDPOINT} "
                          f"failed: {e}")


def _cached(repo_id: str, revision: str | None) -> str | None:
    from huggingface_hub import errors, snapshot_download

    try:
        return snapshot_download(repo_id, revision=revision, local_files_only=True)
    except (errors.LocalEntryNotFoundError, FileNotFoundError):
        return None


def _checked(repo_id: str, path: str) -> str:
    files = sorted(os.listdir(path))
    if not any(f.endswith(".safetensors") for f in files):
        raise ModelLoadError(_no_safetensors(repo_id, files, where=path))
    return path


def _no_safetensors(repo_id: str, files: list[str], where: str | None = None) -> str:
    others = [f for f in files if f.endswith((".gguf", ".bin", ".pt", ".pth"))][:5]
    hint = (f"; download one of its .gguf files (`hf download {repo_id} FILE.gguf`) and pass "
            f"that file" if any(f.endswith(".gguf") for f in others) else "")
    return (f"{repo_id}: no safetensors weights in {where or 'the repository'}"
            f"{f' (it has {others})' if others else ''}; pagedserve loads safetensors or a "
            f".gguf file{hint}, or pick a repository that has safetensors")


def _at(revision: str | None) -> str:
    return f" (revision {revision})" if revision else ""


def _silent_tqdm():
    from tqdm.auto import tqdm

    class Silent(tqdm):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "disable": True})

    return Silent
