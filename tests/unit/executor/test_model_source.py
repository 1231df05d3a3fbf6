"""MODEL to a directory and a served name (pagedserve.executor.model_source, pagedserve.executor.hub): hub ids
from a hub cache written here, offline; the hub's refusals injected, each turned into what
to do; no network is used (the endpoint is a closed local port)."""
import logging
import os
from types import SimpleNamespace

import pytest
from huggingface_hub import HfApi, constants, errors

from pagedserve.executor import hub
from pagedserve.executor.errors import ModelLoadError
from pagedserve.executor.model_loader import load_model
from pagedserve.executor.model_source import DEFAULT_NAME, resolve_model, served_name
from tests.support.hub_cache import COMMIT, write_snapshot


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty hub cache, offline unless a test says otherwise, its endpoint unreachable."""
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.chdir(tmp_path)  # no local directory named like the hub ids
    return tmp_path / "hub"


def refusal(cls, status=401):
    response = SimpleNamespace(status_code=status, headers={}, request=SimpleNamespace(url="u"), url="u",
                               text="")
    return cls(f"{status} Client Error", response=response)


def test_a_hub_id_resolves_offline_to_its_cached_snapshot_and_is_served_by_its_id(cache):
    path = write_snapshot(cache, "tiny-org/tiny-qwen")
    assert resolve_model("tiny-org/tiny-qwen") == path
    assert resolve_model("tiny-org/tiny-qwen", revision=COMMIT) == path
    assert served_name("tiny-org/tiny-qwen", path) == "tiny-org/tiny-qwen"
    assert served_name(path, path) == "tiny-org/tiny-qwen"  # the snapshot's path names its repo
    _, config = load_model(path)
    assert config.family == "llama" and config.num_layers == 2


def test_an_id_not_cached_while_offline_names_HF_HUB_OFFLINE_and_what_to_do(cache):
    write_snapshot(cache, "tiny-org/tiny-qwen")
    with pytest.raises(ModelLoadError) as e:
        resolve_model("tiny-org/elsewhere")
    assert "HF_HUB_OFFLINE=1" in str(e.value) and "hf download tiny-org/elsewhere" in str(e.value)
    assert str(cache) in str(e.value)
    with pytest.raises(ModelLoadError, match="revision v2.*HF_HUB_OFFLINE"):
        resolve_model("tiny-org/tiny-qwen", revision="v2")


def test_a_cached_snapshot_without_safetensors_says_so(cache):
    write_snapshot(cache, "tiny-org/no-weights", weights=False)
    with pytest.raises(ModelLoadError, match="no safetensors weights"):
        resolve_model("tiny-org/no-weights")


def test_a_gated_model_without_a_token_says_set_HF_TOKEN(cache, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hub, "files_to_load", lambda *a: (_ for _ in ()).throw(refusal(errors.GatedRepoError)))
    monkeypatch.setattr("huggingface_hub.get_token", lambda: None)
    with pytest.raises(ModelLoadError) as e:
        resolve_model("meta-llama/Llama-3.1-8B")
    assert "gated" in str(e.value) and "set HF_TOKEN" in str(e.value)
    assert "http://127.0.0.1:9/meta-llama/Llama-3.1-8B" in str(e.value)  # where to accept the terms
    monkeypatch.setattr("huggingface_hub.get_token", lambda: "hf_xxx")
    with pytest.raises(ModelLoadError, match="has no access"):
        resolve_model("meta-llama/Llama-3.1-8B")


@pytest.mark.parametrize("cls, says", [(errors.HfHubHTTPError, "refused the download \\(401\\): set HF_TOKEN"),
                                       (errors.RepositoryNotFoundError, "no model at .*set HF_TOKEN"),
                                       (errors.RevisionNotFoundError, "has no revision 'v9'")])
def test_the_hubs_other_refusals_say_what_to_do(cache, monkeypatch, cls, says):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hub, "files_to_load", lambda *a: (_ for _ in ()).throw(refusal(cls)))
    monkeypatch.setattr("huggingface_hub.get_token", lambda: None)
    with pytest.raises(ModelLoadError, match=says):
        resolve_model("org/private", revision="v9")


def test_no_network_uses_the_cache_and_without_it_says_what_was_tried(cache, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hub, "files_to_load", lambda *a: (_ for _ in ()).throw(ConnectionError("no route")))
    with pytest.raises(ModelLoadError) as e:
        resolve_model("tiny-org/tiny-qwen")
    assert "could not reach http://127.0.0.1:9" in str(e.value) and "no route" in str(e.value)
    assert "not in the Hugging Face cache" in str(e.value)
    path = write_snapshot(cache, "tiny-org/tiny-qwen")
    assert resolve_model("tiny-org/tiny-qwen") == path
    monkeypatch.setattr(hub, "files_to_load", lambda *a: (_ for _ in ()).throw(OSError(28, "No space left")))
    with pytest.raises(ModelLoadError, match="the download failed \\(OSError"):  # not the network's fault
        resolve_model("tiny-org/tiny-qwen")
    monkeypatch.setattr(hub, "files_to_load", lambda *a: (_ for _ in ()).throw(OSError(28, "No space left")))
    with pytest.raises(ModelLoadError, match="the download failed \\(OSError"):  # not the network's fault
        resolve_model("tiny-org/tiny-qwen")


def test_only_the_files_it_loads_are_downloaded(cache, monkeypatch, tmp_path):
    files = ["config.json", "generation_config.json", "tokenizer.json", "README.md", "consolidated.safetensors",
             "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
             "model.safetensors.index.json", "pytorch_model.bin", "original/consolidated.pth"]
    index = tmp_path / "index.json"
    index.write_text('{"weight_map": {"a": "model-00001-of-00002.safetensors", '
                     '"b": "model-00002-of-00002.safetensors", "c": "model-00001-of-00002.safetensors"}}')
    monkeypatch.setattr(HfApi, "list_repo_files", lambda self, repo_id, revision=None: files)
    monkeypatch.setattr("huggingface_hub.hf_hub_download", lambda *a, **k: str(index))
    assert sorted(hub.files_to_load("org/m", None)) == sorted([
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json",
        "config.json", "generation_config.json", "tokenizer.json"])
    monkeypatch.setattr(HfApi, "list_repo_files", lambda self, repo_id, revision=None: [
        "config.json", "model-Q4_K_M.gguf", "pytorch_model.bin"])
    with pytest.raises(ModelLoadError, match="no safetensors.*hf download org/m FILE.gguf"):
        hub.files_to_load("org/m", None)


def test_served_names(tmp_path):
    model_dir = tmp_path / "my-model"
    model_dir.mkdir()
    assert served_name(str(model_dir), str(model_dir)) == "my-model"
    assert served_name(str(tmp_path / "q.Q4_0.gguf"), "/cache/abc") == "q.Q4_0"
    assert served_name(None, "/cache/abc") == DEFAULT_NAME
    assert served_name("org/m", "/x", served_model_name="mine") == "mine"
    assert served_name("org/m", "/x", served_model_name=["mine", "also"]) == "mine"  # the first is reported
    assert served_name("org/m", "/x", served_model_name=[]) == "org/m"
    snapshot = str(tmp_path / "models--org--m" / "snapshots" / COMMIT)
    assert served_name(snapshot, snapshot) == "org/m"
    assert served_name("gpt2", str(tmp_path / "models--gpt2" / "snapshots" / COMMIT)) == "gpt2"


def test_no_model_serves_the_default_and_says_so(monkeypatch):
    from pagedserve.executor import model_source

    monkeypatch.setattr(model_source, "default_model_dir", lambda progress=True: "/the/default")
    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    model_source.log.addHandler(handler)
    try:
        assert resolve_model(None) == "/the/default"
    finally:
        model_source.log.removeHandler(handler)
    assert any("no MODEL given" in m and DEFAULT_NAME in m for m in seen)


def test_what_is_not_a_model_is_refused_by_name(tmp_path, cache):
    with pytest.raises(ModelLoadError, match="--revision v1 applies to a hub id"):
        resolve_model(str(tmp_path), revision="v1")
    with pytest.raises(ModelLoadError, match="no such model directory or .gguf file"):
        resolve_model("./not-here")
    assert not hub.looks_like_hub_id("a/b/c") and not hub.looks_like_hub_id("m.gguf")
    assert hub.looks_like_hub_id("Qwen/Qwen2.5-0.5B-Instruct") and hub.looks_like_hub_id("gpt2")
    assert os.path.basename(resolve_model(str(tmp_path))) == os.path.basename(str(tmp_path))


def test_the_weights_load_shows_a_progress_bar_on_a_terminal_only(cache, capsys):
    path = write_snapshot(cache, "tiny-org/tiny-qwen")
    load_model(path, progress=True)
    err = capsys.readouterr().err
    assert "loading weights" in err and "3/3" in err  # two layers, then the whole model
    load_model(path)  # progress=None: a bar only when stderr is a terminal, and here it is not
    assert "loading weights" not in capsys.readouterr().err


def test_a_relative_directory_is_served_by_its_own_name(tmp_path, monkeypatch):
    (tmp_path / "llama-local").mkdir()
    monkeypatch.chdir(tmp_path / "llama-local")
    assert served_name(".", ".") == "llama-local"
