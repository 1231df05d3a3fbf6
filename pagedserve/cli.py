"""The `pagedserve` command line: one subcommand per job, each defined next to what it runs."""
from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedserve",
        description="Serve language models on a paged key-value cache.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    from pagedserve import advise, generate_cmd, serve_cmd, service_cmds
    from pagedserve.model_arg import add_model_positionals

    serve_cmd.add_parsers(sub)
    service_cmds.add_parsers(sub)
    generate_cmd.add_parser(sub)
    advise.add_parser(sub)

    from pagedserve.benchmarks import cli as bench_cli

    bench_cli.add_parser(sub)
    add_model_positionals(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    from pagedserve import huge_pages

    huge_pages.ask()  # before anything imports torch
    from pagedserve.supervisor import die_with_supervisor

    die_with_supervisor()
    args = build_parser().parse_args(argv)
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
