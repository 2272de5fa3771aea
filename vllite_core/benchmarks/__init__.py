"""Benchmarks in the spirit of vLLM's: offline throughput, batch latency, and a serving client.

``vllite bench {throughput,latency,serve}`` drives these; ``benchmarks/`` in the
repository holds the cross-engine comparison (vllite vs Hugging Face generate vs
vLLM's CPU build). Every result is a plain dict, saved as JSON and printed as a table.
"""
