"""Benchmarks behind ``sparsecomm bench``.

Collectives, optimizers, checkpoints, recovery, convergence, and the fault drill.
"""
