"""Benchmarks behind `torchplace bench NAME`: one module each, sharing `common`.

Each module defines `add_arguments(parser)` and `run(args) -> BenchResult`. A benchmark always
compares, in one run, the naive way, what users would otherwise use, and torchplace's way.
"""
