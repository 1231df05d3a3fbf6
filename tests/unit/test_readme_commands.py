"""Every `pagedserve ...` command README.md shows in a code block parses: the subcommand and
every flag exist and take the values shown (argparse, in process; nothing runs)."""
import re
import shlex

import pytest

from pagedserve.cli import build_parser
from tests.support import REPO

COMMAND = re.compile(r"(?:^|&&\s*)(?:\S*/)?pagedserve\s+(.*?)\s*(?:&&|#|$)")


def readme_commands() -> list[str]:
    with open(REPO / "README.md") as f:
        text = f.read()
    blocks = re.findall(r"```(?:\w+)?\n(.*?)```", text, re.S)
    blocks += re.findall(r"((?:\n    [^\n]*)+)", text)  # indented code blocks
    found = []
    for line in "\n".join(blocks).splitlines():
        for match in COMMAND.finditer(line.strip()):
            found.append(match.group(1))
    return sorted(set(found))


def test_readme_shows_commands():
    commands = readme_commands()
    assert any(c.startswith("serve") for c in commands) and len(commands) >= 5


@pytest.mark.parametrize("command", readme_commands())
def test_readme_command_parses(command):
    args = build_parser().parse_args(shlex.split(command))
    assert callable(args.run)


def test_a_planted_flag_does_not_parse():
    with pytest.raises(SystemExit):
        build_parser().parse_args(shlex.split("serve --no-such-flag 3"))
