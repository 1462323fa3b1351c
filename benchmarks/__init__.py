"""Benchmarks of lightning_par's parallel engines against their torch counterparts (see README.md)."""
