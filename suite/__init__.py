"""The correctness and benchmark suite: ``pytest suite -k correctness``, ``pytest suite --benchmark-only``."""
