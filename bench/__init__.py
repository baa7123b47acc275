"""Benchmarks: accuracy of jaxmem's memory predictions and comparisons against XLA."""
