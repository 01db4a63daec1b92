"""Benchmarks that print figures measured against a reference in the same run."""
