"""Benchmarks and load tools (`pagedserve bench ...`): each prints numbers and writes them to a file.

They sit above the entry points (`pagedserve.engine`, `pagedserve.supervisor`, the service
configs) and below `pagedserve.cli`, which registers them.
"""
