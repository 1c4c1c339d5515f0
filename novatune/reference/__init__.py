"""The fp32 oracle and the Hugging Face stock formula of every op, one file per op; imports no kernel.

Kernels, ops (their CPU path), tests, benchmarks and the tuner's validator all compare against these functions,
so a kernel and the oracle it is checked with never share code.
"""
