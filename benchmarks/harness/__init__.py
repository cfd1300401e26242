"""The parts of benchmarks/benchmark.py: measuring, the peers, train, decode, data, the report."""
