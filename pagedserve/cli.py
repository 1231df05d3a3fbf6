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

    serve_cmd.add_parsers(sub)
    service_cmds.add_parsers(sub)
    generate_cmd.add_parser(sub)
    advise.add_parser(sub)

    bench = sub.add_parser("bench", help="benchmarks that print numbers and write them to a file")
    bench_sub = bench.add_subparsers(dest="bench", metavar="BENCH", required=True)
    from pagedserve import (bench_kernels, bench_kv, bench_policies, bench_serve, bench_sharing,
                            bench_split, bench_throughput)

    bench_kernels.add_parser(bench_sub)
    bench_throughput.add_parser(bench_sub)
    bench_kv.add_parser(bench_sub)
    bench_serve.add_parser(bench_sub)
    bench_split.add_parser(bench_sub)
    bench_policies.add_parser(bench_sub)
    bench_sharing.add_parser(bench_sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
