"""The text rules of scripts/migrate_namespace.py: old module names and paths to new ones.

`Moves` knows what moved (dotted module names and repository paths, old -> new) and what
the old tree held; `rewrite_python` and `rewrite_text` apply it to one file's text:
- imports (`from wire.x import y`, `import wire.x as z`, `import kernels`), split where the
  names of one `from` statement now live in different packages;
- dotted references `wire.x.y` in strings, comments and prose, when `x` is a module of the
  old `wire/` or a name its `__init__.py` defines (so `executor.yaml` stays);
- paths `wire/x.py`, `../memsvc/`, when `x` is in the old folder (so `memsvc/executor` stays);
- in Python code: `ROOT / "wire"`, `Path("wire")`, a bare `"kernels"` listed beside dotted
  module names, and `wire.x` used after a plain `import wire.x`.
"""
from __future__ import annotations

import ast
import io
import keyword
import re
import tokenize
from dataclasses import dataclass, field

PLACEHOLDER = re.compile(r"[<>*{}$]")


@dataclass
class Moves:
    tops: tuple[str, ...]                 # the old top-level packages, now pagedserve.<top>
    modules: dict[str, str]               # old dotted name -> new (packages and moved modules)
    paths: dict[str, str]                 # old repository path -> new (folders and moved files)
    children: dict[str, set[str]]         # old folder path -> the names in it (and its __init__'s)
    bare_imports: list[str] = field(default_factory=list)  # files where `import wire.x` was used

    def module(self, name: str) -> str | None:
        """The new dotted name of an old one, or None if it is not a moved module's."""
        best = max((k for k in self.modules if name == k or name.startswith(k + ".")), key=len, default=None)
        return None if best is None else self.modules[best] + name[len(best):]

    def known(self, name: str) -> bool:
        """`wire.x...`: x is in the old wire/ (a module, a subpackage, or a name of its __init__)."""
        parts = name.split(".")
        return len(parts) > 1 and parts[1] in self.children.get(parts[0], ())

    def dotted_re(self) -> re.Pattern:
        tops = "|".join(map(re.escape, self.tops))
        return re.compile(rf"(?<![\w./\-])(?:{tops})(?:\.\w+)+")

    def path_re(self) -> re.Pattern:
        keys = "|".join(map(re.escape, sorted(self.paths, key=len, reverse=True)))
        return re.compile(rf"(?<![\w./\-])((?:\.\./)*)({keys})(?![\w.\-])(/[^\s`'\"()\[\],;|]*)?")


def rewrite_dotted(text: str, moves: Moves) -> tuple[str, int]:
    count = 0

    def sub(m: re.Match) -> str:
        nonlocal count
        name = m.group(0)
        if not moves.known(name):
            return name
        count += 1
        return moves.module(name)

    return moves.dotted_re().sub(sub, text), count


def rewrite_paths(text: str, moves: Moves) -> str:
    def sub(m: re.Match) -> str:
        up, key, rest = m.group(1), m.group(2), m.group(3) or ""
        if key in moves.children:  # a folder: after ../, or with a name of its own after it, or alone
            if not rest and not up:
                return m.group(0)
            first = rest[1:].split("/")[0].rstrip(".,:;") if rest else ""
            if first and first not in moves.children[key] and not PLACEHOLDER.search(first):
                return m.group(0)
        elif rest:
            return m.group(0)
        return up + moves.paths[key] + rest

    return moves.path_re().sub(sub, text)


def rewrite_text(text: str, moves: Moves) -> str:
    """Prose, shell, YAML, TOML, Dockerfiles, .proto: dotted names and paths."""
    return rewrite_paths(rewrite_dotted(text, moves)[0], moves)


def _rewrite_string(token: str, moves: Moves) -> tuple[str, int]:
    """A string literal's text: an f-string's {expressions} are code, left alone."""
    prefix = re.match(r"[A-Za-z]*", token).group(0)
    quotes = token[len(prefix):len(prefix) + 3]
    if "f" not in prefix.lower() and quotes in ('"""', "'''") and _is_code(token[len(prefix) + 3:-3]):
        body = rewrite_python(token[len(prefix) + 3:-3], moves)  # a program in a string: all the rules
        return prefix + quotes + body + quotes, 1
    if "f" not in prefix.lower():
        new, n = rewrite_dotted(token, moves)
        return rewrite_paths(new, moves), n
    pieces = re.split(r"(\{[^{}]*\})", token)
    out, total = [], 0
    for piece in pieces:
        if piece.startswith("{") and piece.endswith("}") and not piece.startswith("{{"):
            out.append(piece)
        else:
            new, n = rewrite_dotted(piece, moves)
            out.append(rewrite_paths(new, moves))
            total += n
    return "".join(out), total


def _is_code(text: str) -> bool:
    """Python source with an import in it (a script run with -c, say), not prose."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return False
    return any(isinstance(node, (ast.Import, ast.ImportFrom)) for node in ast.walk(tree))


class _Edits:
    """Replacements by (row, col) spans of the token stream, applied at the end."""

    def __init__(self, text: str):
        self.lines = text.splitlines(keepends=True)
        self.edits: list[tuple[tuple[int, int], tuple[int, int], str]] = []

    def add(self, start, end, new: str) -> None:
        if not any(e[0] == start for e in self.edits):  # the first rule to claim a token wins
            self.edits.append((start, end, new))

    def apply(self) -> str:
        offsets = [0]
        for line in self.lines:
            offsets.append(offsets[-1] + len(line))
        text = "".join(self.lines)
        for start, end, new in sorted(self.edits, reverse=True):
            a = offsets[start[0] - 1] + start[1]
            b = offsets[end[0] - 1] + end[1]
            text = text[:a] + new + text[b:]
        return text


def _significant(tokens):
    return [t for t in tokens if t.type not in (tokenize.NL, tokenize.COMMENT)]


def _dotted_at(toks, i):
    """The dotted name starting at toks[i]: (name, index after it)."""
    parts = [toks[i].string]
    j = i + 1
    while j + 1 < len(toks) and toks[j].string == "." and toks[j + 1].type == tokenize.NAME:
        parts.append(toks[j + 1].string)
        j += 2
    return ".".join(parts), j


def _import_names(toks, j):
    """After `import`: [(name, alias, start_index, end_index)], index after the list."""
    names = []
    paren = toks[j].string == "("
    if paren:
        j += 1
    while j < len(toks) and toks[j].type == tokenize.NAME:
        start = j
        name, j = _dotted_at(toks, j)
        alias = None
        if j < len(toks) and toks[j].string == "as":
            alias = toks[j + 1].string
            j += 2
        names.append((name, alias, start, j))
        if j < len(toks) and toks[j].string == ",":
            j += 1
    if paren:
        j += 1
    return names, j


def rewrite_python(text: str, moves: Moves, path: str = "") -> str:
    """One Python file: imports, string literals, comments and the code forms named above."""
    every = list(tokenize.generate_tokens(io.StringIO(text).readline))
    toks = _significant(every)
    edits = _Edits(text)
    for tok in every:
        if tok.type == tokenize.COMMENT:
            new = rewrite_text(tok.string, moves)
            if new != tok.string:
                edits.add(tok.start, tok.end, new)
    bound: set[str] = set()   # tops bound by `import top.x` (no alias): code says top.x.y
    in_import: set[int] = set()
    for i, tok in enumerate(toks):
        if tok.type != tokenize.NAME or tok.string not in ("from", "import"):
            continue
        prev = toks[i - 1] if i else None
        if prev is not None and prev.type not in (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                                                  tokenize.ENCODING) and prev.string not in (";", ":"):
            continue
        if tok.string == "from":
            if toks[i + 1].string == ".":
                continue  # relative: inside one package, which moves whole
            module, j = _dotted_at(toks, i + 1)
            names, end = _import_names(toks, j + 1)
            in_import.update(range(i, end))
            if moves.module(module) is None and not any(moves.module(f"{module}.{n}") for n, *_ in names):
                continue
            groups: dict[str, list[str]] = {}
            for name, alias, _, _ in names:
                new = moves.module(f"{module}.{name}") or f"{module}.{name}"
                parent, _, leaf = new.rpartition(".")
                groups.setdefault(parent, []).append(leaf + (f" as {alias}" if alias else ""))
            if len(groups) == 1:
                edits.add(toks[i + 1].start, toks[j - 1].end, next(iter(groups)))
            else:
                indent = " " * tok.start[1]
                body = f"\n{indent}".join(f"from {p} import {', '.join(n)}" for p, n in groups.items())
                edits.add(tok.start, toks[end - 1].end, body)
        else:
            names, end = _import_names(toks, i + 1)
            in_import.update(range(i, end))
            if not any(moves.module(name) for name, *_ in names):
                continue
            plain, froms = [], []
            for name, alias, _, _ in names:
                top = name.split(".")[0]
                if moves.module(name) is None:
                    plain.append(name + (f" as {alias}" if alias else ""))
                elif name == top and alias is None:  # `import kernels` binds kernels: so does this
                    froms.append(f"from pagedserve import {top}")
                else:
                    plain.append(moves.module(name) + (f" as {alias}" if alias else ""))
                    if alias is None:
                        bound.add(top)  # code then says top.x: rewritten below
            statements = ([f"import {', '.join(plain)}"] if plain else []) + froms
            line_start = prev is None or prev.type in (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                                                       tokenize.ENCODING)
            joint = f"\n{' ' * tok.start[1]}" if line_start else "; "
            edits.add(tok.start, toks[end - 1].end, joint.join(statements))
    if bound:
        moves.bare_imports.append(path)
    _rewrite_code_and_strings(toks, moves, edits, bound, in_import)
    return edits.apply()


def _rewrite_code_and_strings(toks, moves: Moves, edits: _Edits, bound: set[str], in_import: set[int]) -> None:
    # per open bracket: is it a literal (not a call or subscript), and its strings (index, rewritten)
    groups: list[tuple[bool, list[tuple[int, bool]]]] = [(False, [])]
    line, lines, rooted = 0, [], set()  # logical line of each token; those that build ROOT / ... paths
    for i, tok in enumerate(toks):
        lines.append(line)
        if tok.type == tokenize.NEWLINE:
            line += 1
        elif tok.type == tokenize.NAME and re.search("ROOT|REPO", tok.string) and i + 1 < len(toks) \
                and toks[i + 1].string == "/":
            rooted.add(line)
    for i, tok in enumerate(toks):
        if tok.type == tokenize.OP and tok.string in "([{":
            prev = toks[i - 1] if i else None
            call = prev is not None and ((prev.type == tokenize.NAME and not keyword.iskeyword(prev.string))
                                         or prev.string in (")", "]"))
            groups.append((not call, []))
        elif tok.type == tokenize.OP and tok.string in ")]}" and len(groups) > 1:
            literal, group = groups.pop()
            if literal and lines[i] in rooted:  # `for d in ("memsvc", ...) ... ROOT / d`: folders
                for k, _ in group:
                    _bare_string(toks[k], moves, edits, lambda t: f"pagedserve/{t}")
            elif literal and any(done for _, done in group):  # beside dotted module names: a module
                for k, _ in group:
                    _bare_string(toks[k], moves, edits, lambda t: f"pagedserve.{t}")
        elif tok.type == tokenize.STRING:
            new, n = _rewrite_string(tok.string, moves)
            if new != tok.string:
                edits.add(tok.start, tok.end, new)
            groups[-1][1].append((i, n > 0))
            before = toks[i - 1].string if i else ""
            if before == "/" and i > 1 and re.search("ROOT|REPO", toks[i - 2].string):
                _bare_string(tok, moves, edits, lambda t: f'pagedserve" / "{t}')
            elif before == "(" and i > 1 and toks[i - 2].string == "Path":
                _bare_string(tok, moves, edits, lambda t: f'pagedserve", "{t}')
        elif (tok.type == tokenize.NAME and tok.string in bound and i not in in_import
              and (i == 0 or toks[i - 1].string != ".") and i + 1 < len(toks) and toks[i + 1].string == "."):
            name, j = _dotted_at(toks, i)
            if moves.known(name):
                edits.add(tok.start, toks[j - 1].end, moves.module(name))


def _bare_string(tok, moves: Moves, edits: _Edits, form) -> None:
    """A string literal that is exactly an old top package's name, rewritten by `form`."""
    try:
        value = ast.literal_eval(tok.string)
    except (ValueError, SyntaxError):
        return
    if value in moves.tops:
        quote = tok.string[-1]
        edits.add(tok.start, tok.end, quote + form(value).replace('"', quote) + quote)
