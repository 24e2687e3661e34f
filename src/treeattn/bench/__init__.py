"""Benchmarks (extra ``[bench]``): latency, memory, communication, end-to-end, and a cost model."""
