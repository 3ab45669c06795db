"""Benchmark of this package against ``transformers.Trainer`` and a plain Accelerate loop.

Run ``python bench/run.py --help``; see the "Performance" section of the README.
"""
