"""Every repository path the documents name exists, so a move or a rename cannot leave a
document pointing at nothing.

What counts as a path (docs/ARCHITECTURE.md is the document of record; the others too):
- a markdown link's target, relative to the document;
- anything written from a top-level folder of the repository (`tests/...`, `pagedserve/gateway/...`,
  `../pagedserve/wire/...`), in prose, code spans and code blocks alike: it must exist exactly;
- a code span such as `models/llama.py` or `integration/` (from a folder's name, or to a
  file's): some path ends with it;
- a file name such as `gemma.py`: some file has that name.
Placeholders (`<op>_ref.py`, `*.proto`, `$OUT/...`), absolute paths, URLs and git-ignored
outputs (`bench_results/...`) are not repository paths.
"""
from __future__ import annotations

import fnmatch
import os
import re
from pathlib import Path

import pytest

from tests.support import REPO

DOCUMENTS = ("README.md", "RELIABILITY.md", "BENCHMARKS.md", "DEVELOPERS.md", "deploy/README.md",
             "docs/ARCHITECTURE.md", "docs/benchmark-history.md")
NOT_PATHS = {"deploy/pagedserve-otel-collector": "a Kubernetes resource (kubectl logs deploy/NAME)"}
EXTENSIONS = "py|sh|md|proto|toml|yaml|yml|png|txt|cfg|ini"
PLACEHOLDER = re.compile(r"[<>*{}$~]")
URL = re.compile(r"[a-z]+://\S*")
LINK = re.compile(r"\]\(([^)\s]+)\)")
SPAN = re.compile(r"`([^`\s]+)`")
NAME = re.compile(rf"(?<![\w./\\<>-])[\w\\]+\.(?:{EXTENSIONS})\b")


def gitignore_patterns() -> list[str]:
    path = REPO / ".gitignore"
    lines = path.read_text().splitlines() if path.exists() else []
    return [line.strip().rstrip("/") for line in lines if line.strip() and not line.startswith("#")]


def repository_files(ignored: list[str]) -> set[str]:
    """The files under the repository root, less .git and what .gitignore leaves out (read
    from disk: no git process)."""
    out = set()
    for folder, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if d != ".git" and not any(fnmatch.fnmatch(d, p) for p in ignored)]
        rel = Path(folder).relative_to(REPO)
        out.update(str(rel / f) for f in files if not any(fnmatch.fnmatch(f, p) for p in ignored))
    return {f[2:] if f.startswith("./") else f for f in out}


class Tree:
    """The repository's files and folders, and .gitignore's patterns."""

    def __init__(self, files: set[str], ignored: list[str]):
        self.files = files
        self.ignored = ignored
        self.dirs = {str(Path(*Path(f).parts[:i])) for f in files for i in range(1, len(Path(f).parts))}
        self.names = {Path(f).name for f in files}
        self.dir_names = {Path(d).name for d in self.dirs}
        self.tops = sorted({f.split("/")[0] for f in files if "/" in f})
        self.rooted = re.compile(r"(?<![\w./\\-])(?:\.\./)*(?:%s)/[\w./\\-]*"
                                 % "|".join(map(re.escape, self.tops)))

    def exists(self, path: str) -> bool:
        return path in self.files or path in self.dirs or path == "."

    def is_ignored(self, path: str) -> bool:
        parts = Path(path).parts
        return any(fnmatch.fnmatch(part, pat) or fnmatch.fnmatch("/".join(parts[:i + 1]), pat)
                   for pat in self.ignored for i, part in enumerate(parts))

    def ends_with(self, fragment: str) -> bool:
        return any(p == fragment or p.endswith("/" + fragment) for p in self.files | self.dirs)


def clean(token: str) -> str:
    return token.replace("\\", "").rstrip(".,;:)").split("#")[0]


def missing_paths(document: str, text: str, tree: Tree) -> list[str]:
    """`document:line: path` for each path named in `text` that does not exist."""
    here = Path(document).parent
    bad = []

    def check(n: int, token: str, ok) -> None:
        path = clean(token)
        if (not path or PLACEHOLDER.search(token) or path.startswith("/") or path in NOT_PATHS
                or tree.is_ignored(os.path.normpath(path))):
            return
        if not ok(path):
            bad.append(f"{document}:{n}: {path}")

    def at_root_or_here(path: str) -> bool:
        return (tree.exists(os.path.normpath(here / path)) or
                (not path.startswith("..") and tree.exists(os.path.normpath(path))))

    for n, line in enumerate(text.splitlines(), 1):
        rest = line
        for m in LINK.finditer(line):
            if not URL.match(m.group(1)) and not m.group(1).startswith(("#", "mailto:")):
                check(n, m.group(1), lambda p: tree.exists(os.path.normpath(here / p)))
        rest = URL.sub(" ", LINK.sub("]", rest))
        for m in tree.rooted.finditer(rest):
            if rest[m.end():m.end() + 1] not in ("<", "*", "{", "$"):
                check(n, m.group(0), at_root_or_here)
        for m in SPAN.finditer(rest):
            token = m.group(1)
            if ("/" in token and not tree.rooted.match(token) and not token.startswith(".")
                    and (token.split("/")[0] in tree.dir_names or NAME.fullmatch(token.split("/")[-1]))):
                check(n, token, lambda p: at_root_or_here(p) or tree.ends_with(p.rstrip("/")))
        for m in NAME.finditer(rest):
            check(n, m.group(0), lambda p: p in tree.names)
    return bad


def heading_anchors(text: str) -> set[str]:
    """The anchors GitHub gives a markdown file's headings: lower case, punctuation dropped,
    spaces as hyphens, a repeated one suffixed -1, -2, ..."""
    anchors: set[str] = set()
    for line in text.splitlines():
        if m := re.match(r"#+ (.*)", line):
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            n = 0
            while (slug if n == 0 else f"{slug}-{n}") in anchors:
                n += 1
            anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def missing_anchors(document: str, text: str) -> list[str]:
    """`document:line: target` for each link to `FILE.md#anchor` (or `#anchor`) whose file has
    no heading with that anchor."""
    bad = []
    for n, line in enumerate(text.splitlines(), 1):
        for m in LINK.finditer(line):
            path, _, anchor = m.group(1).partition("#")
            if not anchor or URL.match(path) or not (path == "" or path.endswith(".md")):
                continue
            target = (REPO / Path(document).parent / path) if path else REPO / document
            if not target.exists() or anchor not in heading_anchors(target.read_text()):
                bad.append(f"{document}:{n}: {m.group(1)}")
    return bad


@pytest.fixture(scope="module")
def tree() -> Tree:
    ignored = gitignore_patterns()
    return Tree(repository_files(ignored), ignored)


@pytest.mark.parametrize("document", DOCUMENTS)
def test_every_path_a_document_names_exists(document, tree):
    bad = missing_paths(document, (REPO / document).read_text(), tree)
    assert not bad, ("paths named in the documents that do not exist (fix the document, or "
                     "NOT_PATHS if it is no path):\n" + "\n".join(bad))


def test_a_planted_path_is_found(tree):
    text = ("intro\nsee [the server](../gateway/no_such.py) and `tests/test_gone.py`,\n"
            "`models/absent.py` and vanished_module.py; but `<op>_ref.py`, "
            "`bench_results/x.json` and https://example.com/tests/a.py are fine\n"
            "    pytest tests/test_at_line_end.py\n")
    assert missing_paths("docs/X.md", text, tree) == [
        "docs/X.md:2: ../gateway/no_such.py", "docs/X.md:2: tests/test_gone.py",
        "docs/X.md:3: models/absent.py", "docs/X.md:3: vanished_module.py",
        "docs/X.md:4: tests/test_at_line_end.py"]


def test_existing_paths_pass(tree):
    text = ("[server](../pagedserve/gateway/server.py), `pagedserve/wire/protocol.py`, `models/llama.py`, "
            "gemma.py, `tests/support/`\n")
    assert missing_paths("docs/X.md", text, tree) == []


@pytest.mark.parametrize("document", DOCUMENTS)
def test_every_anchor_a_document_links_exists(document):
    bad = missing_anchors(document, (REPO / document).read_text())
    assert not bad, "links to a heading that is not there (its title changed?):\n" + "\n".join(bad)


def test_a_planted_anchor_is_found():
    text = ("[a](BENCHMARKS.md#how-a-benchmark-is-run) [b](BENCHMARKS.md#no-such-heading)\n"
            "[c](docs/ARCHITECTURE.md#layering) [d](#nowhere) [e](https://x.org/a.md#y)\n")
    assert missing_anchors("README.md", text) == [
        "README.md:1: BENCHMARKS.md#no-such-heading", "README.md:2: #nowhere"]
    assert heading_anchors("# A b\n## Who: may (call)?\n# A b\n") == {"a-b", "who-may-call", "a-b-1"}
