"""The CPU a benchmark ran on: wire.cpu_info (the executor keys its linear plan by it too)."""
from wire.cpu_info import ISA_FLAGS, cpu_info, describe  # noqa: F401
