"""Benchmarks: `lightwell bench serve | throughput | latency` (PERFORMANCE.md workloads W1-W3).

`serve` (the load generator) needs only aiohttp, numpy and a tokenizer; `throughput` and
`latency` drive the offline Python API and import nothing from ``lightwell.server``.
"""
