"""Benchmarks behind ``pagewise bench ...``."""
