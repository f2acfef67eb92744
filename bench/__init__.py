"""Benchmarks: kvstrata's router against vllm-router and sglang-router (`make bench-router`, `make bench-proxy`).

Benchmarks print figures and write JSON under `.bench/`; they are not tests and never pass or fail on speed.
"""
