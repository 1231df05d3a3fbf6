"""One Python namespace (issue 43) and `wire/` the contract only (issue 41): a one-time migration.

Run once, at the root of a clean checkout (main, after the day's merges):

    python scripts/migrate_namespace.py        # the project's venv: it runs proto/generate.py

It moves (git mv) the top-level packages `wire`, `kernels`, `memsvc`, `executor`, `gateway`,
`benchmarks` into `pagedserve/`, the RPC runtime and the pool sharing out of `wire/` into
`pagedserve/rpc/` and `pagedserve/pool_share/` (SPLIT; a listed module no longer in `wire/` is
skipped), `proto/wire/` to `proto/pagedserve/wire/`; rewrites every import, dotted module name
and path in the tracked files (scripts/namespace_rewrite.py); regenerates the gRPC stubs
(the proto package, hence the services' names on the wire, is unchanged); writes pyproject's
packages list and lifts the transformers pin; installs the tests written for the new layout
(scripts/namespace_templates/) and removes itself. It stages the result and commits nothing.
It refuses a tree with uncommitted changes, and a tree already migrated.
"""
from __future__ import annotations

import ast
import hashlib
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from namespace_rewrite import Moves, rewrite_python, rewrite_text

ROOT = Path(__file__).resolve().parent.parent
TOPS = ("wire", "kernels", "memsvc", "executor", "gateway", "benchmarks")
SPLIT = {
    "rpc": ("step_channel", "grpc_service", "tls", "peer_auth", "internal_auth", "tracing", "health_port",
            "metrics", "daemon_pool", "heap"),
    "pool_share": ("shm_pool", "cuda_ipc", "device"),
}
SPLIT_DOCS = {
    "rpc": "The services' RPC runtime: the gRPC server and channels, the step channel, TLS and peer\n"
           "authentication, the internal token, tracing, health and metrics listeners. Above\n"
           "pagedserve.wire (the contract), below everything else (docs/ARCHITECTURE.md).\n",
    "pool_share": "The KV pool shared between processes: POSIX shared memory on a CPU, CUDA IPC on a GPU,\n"
                  "and the devices they live on. Above pagedserve.wire, below everything else\n"
                  "(docs/ARCHITECTURE.md).\n",
}
SELF = ["scripts/migrate_namespace.py", "scripts/namespace_rewrite.py", "scripts/namespace_templates"]
TEMPLATES = {"test_layers.py": "tests/unit/test_layers.py", "test_namespace.py": "tests/unit/test_namespace.py"}
# tests/unit/test_layers.py as these templates were written against (main at 4520ab5): a
# different file means someone changed the old layering test since; port the change by hand.
LAYERS_SHA256 = "d521be66e128910b6366eaea0e0156d8216ef63929962a3ecd4182c0b2d03f12"
NOT_REWRITTEN = re.compile(r"^(shared/|wire/v1/.*_pb2|scripts/namespace_templates/)|\.json$")


def git(*args: str, capture: bool = True) -> str:
    done = subprocess.run(["git", *args], cwd=ROOT, check=True, text=True,
                          stdout=subprocess.PIPE if capture else None)
    return done.stdout or ""


def refuse_unless_ready() -> None:
    if (ROOT / "pagedserve" / "wire").exists() or not (ROOT / "wire").is_dir():
        sys.exit("already migrated: pagedserve/wire/ exists (or wire/ does not). Nothing done; "
                 "this script runs once.")
    others = sorted(p.parent.name for p in ROOT.glob("*/__init__.py"))
    others = [p for p in others if p not in (*TOPS, "pagedserve", "tests")]
    if others:
        sys.exit(f"top-level packages this script does not know: {others}; add them to TOPS. Nothing done.")
    dirty = git("status", "--porcelain", "--untracked-files=no")
    if dirty:
        sys.exit("the tree has uncommitted changes; commit or stash them first (the migration is "
                 "undone with `git reset --hard && git clean -fd pagedserve proto tests`):\n" + dirty)


def init_names(path: Path) -> set[str]:
    """The names a package's __init__.py defines or imports at its top level."""
    if not path.exists():
        return set()
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


def plan(files: list[str]) -> tuple[Moves, list[tuple[str, str]]]:
    """What moves where: the rewrite rules and the (old, new) paths to git mv, files first."""
    moves = Moves(tops=TOPS, modules={}, paths={}, children={})
    renames = []
    for package, names in SPLIT.items():
        for name in names:
            if f"wire/{name}.py" not in files:
                print(f"skipped: wire/{name}.py is no longer in wire/")
                continue
            moves.modules[f"wire.{name}"] = f"pagedserve.{package}.{name}"
            renames.append((f"wire/{name}.py", f"pagedserve/{package}/{name}.py"))
            test = f"tests/unit/wire/test_{name}.py"
            if test in files:
                renames.append((test, f"tests/unit/{package}/test_{name}.py"))
                moves.modules[f"tests.unit.wire.test_{name}"] = f"tests.unit.{package}.test_{name}"
    for top in TOPS:
        moves.modules[top] = f"pagedserve.{top}"
        renames.append((top, f"pagedserve/{top}"))
        if (ROOT / "proto" / top).is_dir():
            renames.append((f"proto/{top}", f"proto/pagedserve/{top}"))
    for old, new in renames:
        moves.paths[old] = new
    for folder in [old for old, _ in renames if (ROOT / old).is_dir()]:
        names = {f.split("/")[folder.count("/") + 1] for f in files if f.startswith(folder + "/")}
        moves.children[folder] = names | {n[:-3] for n in names if n.endswith(".py")}
        moves.children[folder] |= init_names(ROOT / folder / "__init__.py")
    return moves, renames


def moves_path(moves: Moves, old: str) -> str:
    """Where the file at `old` is after the moves."""
    best = max((k for k in moves.paths if old == k or old.startswith(k + "/")), key=len, default=None)
    return old if best is None else moves.paths[best] + old[len(best):]


def move(renames: list[tuple[str, str]]) -> None:
    for old, new in renames:
        (ROOT / new).parent.mkdir(parents=True, exist_ok=True)
        git("mv", old, new)
    for package, doc in SPLIT_DOCS.items():
        init = ROOT / "pagedserve" / package / "__init__.py"
        if init.parent.is_dir() and not init.exists():
            init.write_text(f'"""{doc}"""\n')


def rewrite_file(rel: str, text: str, moves: Moves, packages: list[str]) -> str:
    name = Path(rel).name
    if rel.endswith(".py"):
        return rewrite_python(text, moves, rel)
    if name.startswith("Dockerfile") and name.endswith(".dockerignore"):
        return "".join(line for line in text.splitlines(keepends=True) if line.strip()[1:] not in TOPS)
    if name.startswith("Dockerfile"):
        copies = re.compile(rf"^COPY ({'|'.join(TOPS)}) \1\s*$")
        text = "".join(line for line in text.splitlines(keepends=True) if not copies.match(line))
    if rel == "pyproject.toml":
        return pyproject(text, packages)
    return rewrite_text(text, moves)


def packages_after(files: list[str], moves: Moves) -> list[str]:
    """Every package under pagedserve/ once moved: the folders with an __init__.py."""
    inits = [moves_path(moves, f) for f in files if f.endswith("__init__.py")]
    inits += [f"pagedserve/{p}/__init__.py" for p in SPLIT if any(v.startswith(f"pagedserve.{p}.")
                                                                  for v in moves.modules.values())]
    return sorted({".".join(Path(i).parent.parts) for i in inits if i.startswith("pagedserve/")})


def pyproject(text: str, packages: list[str]) -> str:
    """The packages listed; transformers without the upper bound that dodged Hugging Face's `kernels`."""
    listed = ", ".join(f'"{p}"' for p in packages)
    text, n = re.subn(r"^packages = \[.*?\]$", f"packages = [{listed}]", text, flags=re.MULTILINE | re.DOTALL)
    if n != 1:
        sys.exit("pyproject.toml: no `packages = [...]` line under [tool.setuptools] to replace; nothing done")
    text = re.sub(r"(?:^ *#[^\n]*(?:5\.25|kernels)[^\n]*\n)+(?=(?:^ *#[^\n]*\n)*^ *\"transformers)", "",
                  text, flags=re.MULTILINE)
    text = re.sub(r"^ *#[^\n]*our kernels/ package[^\n]*\n", "", text, flags=re.MULTILINE)
    return re.sub(r'"transformers([^",]*),<5\.25"', r'"transformers\1"', text)


def rewrite_all(files: list[str], moves: Moves) -> dict[str, str]:
    """The new text of every tracked file the rules change, by its old path (nothing written)."""
    packages = packages_after(files, moves)
    out = {}
    for rel in files:
        path = ROOT / rel
        if rel in SELF or rel in TEMPLATES.values() or NOT_REWRITTEN.search(rel) or not path.is_file():
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        new = rewrite_file(rel, text, moves, packages)
        if new != text:
            out[rel] = new
    return out


def layers_changed() -> bool:
    layers = ROOT / TEMPLATES["test_layers.py"]
    return layers.exists() and hashlib.sha256(layers.read_bytes()).hexdigest() != LAYERS_SHA256


def install_templates() -> list[str]:
    out = []
    for name, dest in TEMPLATES.items():
        shutil.copyfile(ROOT / "scripts/namespace_templates" / name, ROOT / dest)
        out.append(dest)
    return out


def unsorted_imports(paths: list[str]) -> set[str] | None:
    """The files among `paths` whose imports ruff finds unsorted (I001); None without ruff."""
    ruff = Path(sys.executable).parent / "ruff"
    if not ruff.exists() or not paths:
        return None
    done = subprocess.run([str(ruff), "check", "--select", "I001", "--output-format", "concise", "--quiet", *paths],
                          check=False, cwd=ROOT, text=True, capture_output=True)
    return {line.split(":")[0] for line in done.stdout.splitlines() if ":" in line}


def sort_imports(changed: list[str], unsorted_before: set[str] | None) -> None:
    """Sort the imports the rewrite unsorted (pagedserve.wire now sorts among pagedserve.*),
    in the files that were sorted before; the others are left as they were."""
    if unsorted_before is None:
        print("NOTE: no ruff beside this Python: imports the rewrite reordered are left unsorted")
        return
    fix = [p for p in changed if p.endswith(".py") and p not in unsorted_before]
    if fix:
        subprocess.run([str(Path(sys.executable).parent / "ruff"), "check", "--select", "I001", "--fix",
                        "--quiet", *fix], check=False, cwd=ROOT, capture_output=True)


def leftovers() -> list[str]:
    """Imports of an old top-level package still in a tracked Python file."""
    pattern = re.compile(rf"^\s*(?:from|import) (?:{'|'.join(TOPS)})\b", re.MULTILINE)
    bad = []
    for rel in git("ls-files", "*.py").splitlines():
        path = ROOT / rel
        if rel not in SELF and path.exists() and pattern.search(path.read_text()):
            bad.append(rel)
    return bad


def main() -> None:
    started = time.monotonic()
    refuse_unless_ready()
    if layers_changed():
        print("NOTE: tests/unit/test_layers.py changed since this script was written; it is replaced "
              "by the new layering test: port the change by hand (git diff HEAD -- tests/unit/test_layers.py)")
    files = git("ls-files").splitlines()
    moves, renames = plan(files)
    texts = rewrite_all(files, moves)  # first, so that a file the rules cannot read stops it before any move
    unsorted_before = unsorted_imports([f for f in files if f.endswith(".py")])
    move(renames)
    changed = [moves_path(moves, rel) for rel in texts]
    for rel, text in texts.items():
        (ROOT / moves_path(moves, rel)).write_text(text)
    sort_imports(changed, {moves_path(moves, f) for f in unsorted_before} if unsorted_before is not None else None)
    subprocess.run([sys.executable, "proto/generate.py"], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    written = install_templates()
    git("add", "-A", "--", "pagedserve", "proto", "tests", *changed, *written)
    git("rm", "-r", "-q", "--ignore-unmatch", "--", *SELF)
    for rel in SELF:  # untracked copies too
        shutil.rmtree(ROOT / rel) if (ROOT / rel).is_dir() else (ROOT / rel).unlink(missing_ok=True)
    bad = leftovers()
    print(f"moved {len(renames)} paths, rewrote {len(changed)} files, regenerated the stubs, "
          f"wrote {', '.join(written)}; removed {', '.join(SELF)}")
    if moves.bare_imports:
        print("code after `import old.module` rewritten in (check them):", ", ".join(moves.bare_imports))
    if bad:
        sys.exit("old imports left (fix by hand): " + ", ".join(bad))
    print(f"done in {time.monotonic() - started:.0f} s; staged, nothing committed. Next: reinstall "
          "(pip install -e . --no-deps), run ruff and the tests, then commit.")


if __name__ == "__main__":
    main()
