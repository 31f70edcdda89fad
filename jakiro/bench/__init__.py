"""Benchmarks: commands that measure and write JSON."""
