"""`pagedserve bench BENCH`: registers every benchmark's subcommand."""
from __future__ import annotations


def add_parser(sub) -> None:
    from pagedserve.benchmarks import (control_plane, fuzz, kernels, kv, kv_dtype_accuracy, multiturn, policies,
                                       profile, sampler_cost, serve, sharing, split, step_cost,
                                       structured_schemas, throughput)

    bench = sub.add_parser("bench", help="benchmarks that print numbers and write them to a file")
    bench_sub = bench.add_subparsers(dest="bench", metavar="BENCH", required=True)
    for module in (kernels, throughput, profile, kv, serve, split, policies, sharing,
                   control_plane, step_cost, multiturn, structured_schemas, fuzz, kv_dtype_accuracy,
                   sampler_cost):
        module.add_parser(bench_sub)
