"""Benchmarks behind `pdserve bench ...`: each prints a table for people, then one JSON line."""
