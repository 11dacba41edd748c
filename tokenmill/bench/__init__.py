"""Benchmarks that run tokenmill beside reference systems in one process and print a table."""
