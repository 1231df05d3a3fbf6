"""The CPU a benchmark ran on: pagedserve.wire.cpu_info (the executor keys its linear plan by it too)."""
from pagedserve.wire.cpu_info import ISA_FLAGS, cpu_info, describe  # noqa: F401
