"""One cache root for the kernels' builds, the converted models and the linear plan
(pagedserve/wire/cache_dir.py): $PAGEDSERVE_CACHE moves all three, $XDG_CACHE_HOME the default."""
import os

from pagedserve.executor import gguf_convert, linear_plan_cache
from pagedserve.kernels import native_build
from pagedserve.wire.cache_dir import cache_dir


def where() -> tuple[str, str, str]:
    return native_build.cache_dir(), gguf_convert.cache_root(), linear_plan_cache.path()


def test_one_variable_moves_every_cached_thing(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "c"))
    assert where() == (str(tmp_path / "c" / "kernels"), str(tmp_path / "c" / "models"),
                       str(tmp_path / "c" / "linear-plan.json"))


def test_the_default_root_follows_xdg_then_home(tmp_path, monkeypatch):
    monkeypatch.delenv("PAGEDSERVE_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir("models") == str(tmp_path / "xdg" / "pagedserve" / "models")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert all(p.startswith(os.path.join(str(tmp_path / "home"), ".cache", "pagedserve", "")) for p in where())
