"""The committed stubs in pagedserve/wire/v1/ match what proto/generate.py makes from proto/."""
import importlib.util

from tests.support import REPO as ROOT


def _generate_module():
    spec = importlib.util.spec_from_file_location("proto_generate", ROOT / "proto" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_stubs_are_fresh(tmp_path):
    fresh = _generate_module().generate(tmp_path)
    assert fresh, "protoc produced no stubs"
    committed_dir = ROOT / "pagedserve" / "wire" / "v1"
    for path in fresh:
        committed = committed_dir / path.name
        assert committed.exists(), f"{committed} is missing: run python proto/generate.py"
        assert committed.read_text() == path.read_text(), (
            f"{committed} is stale: run python proto/generate.py and commit the result"
        )
    extra = {p.name for p in committed_dir.glob("*_pb2*.py")} - {p.name for p in fresh}
    assert not extra, f"stubs without a .proto: {sorted(extra)}"


def test_stubs_import_and_name_the_services():
    from pagedserve.wire.v1 import executor_pb2, generation_pb2, memory_pb2

    assert "MemoryManager" in memory_pb2.DESCRIPTOR.services_by_name
    assert "Executor" in executor_pb2.DESCRIPTOR.services_by_name
    assert "Generation" in generation_pb2.DESCRIPTOR.services_by_name
