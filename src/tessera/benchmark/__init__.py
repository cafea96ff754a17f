"""The benchmark suite behind ``tessera bench --scenario``.

A scenario file (``benchmarks/scenarios/*.yaml``) names a workload (tenants,
models, closed or open loop, bounds) and the configurations to serve it with:
tessera itself, its baselines (raw, dedicated, static partition, FIFO) and
peer servers. The runner serves the workload with each configuration in turn,
on this machine, and writes one report (JSON, Markdown, PNG plots).
"""
