"""pyproject.toml's grpcio and protobuf floors are the versions the committed stubs check at
import: `GRPC_GENERATED_VERSION` in pagedserve/wire/v1/*_pb2_grpc.py and the gencode version given to
ValidateProtobufRuntimeVersion in pagedserve/wire/v1/*_pb2.py. A lower floor installs a runtime the
stubs refuse."""
import ast
import sys

from tests.support import REPO

sys.path.insert(0, str(REPO / "scripts"))
import gpu_packages  # noqa: E402

STUBS = REPO / "pagedserve" / "wire" / "v1"


def grpc_generated_versions() -> set[str]:
    out = set()
    for path in STUBS.glob("*_pb2_grpc.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "GRPC_GENERATED_VERSION":
                out.add(node.value.value)
    return out


def protobuf_gencode_versions() -> set[str]:
    out = set()
    for path in STUBS.glob("*_pb2.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "ValidateProtobufRuntimeVersion":
                major, minor, patch, suffix = (a.value for a in node.args[1:5])
                out.add(f"{major}.{minor}.{patch}{suffix}")
    return out


def test_the_floors_are_the_stubs_versions():
    floors = gpu_packages.floors()
    assert grpc_generated_versions() == {floors["grpcio"]}
    assert protobuf_gencode_versions() == {floors["protobuf"]}
    for sibling in ("grpcio-tools", "grpcio-health-checking", "grpcio-reflection"):  # released with grpcio
        assert floors[sibling] == floors["grpcio"], sibling


def test_the_installed_runtime_meets_them():
    import google.protobuf
    import grpc

    assert gpu_packages.problems() == []
    assert not gpu_packages.below_floor("grpcio", grpc.__version__)
    assert not gpu_packages.below_floor("protobuf", google.protobuf.__version__)
    assert gpu_packages.below_floor("protobuf", "5.29.5") and gpu_packages.below_floor("grpcio", "1.71.0")
