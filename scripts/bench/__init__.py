"""The sections of scripts/benchmark.py: measuring, the peers, train, decode, data, the report."""
