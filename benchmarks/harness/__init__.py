"""The benchmark harness: the one home of every benchmark's code.

It lives in the source checkout, not in the installed package: ``tessera bench``
puts ``benchmarks/`` on ``sys.path`` and imports it from there (so does
``benchmarks/engine_bench.py``, run as a script from that folder; the tests get
it through pytest's ``pythonpath``). Arrows point one way: the harness imports
``tessera``, ``tessera`` never imports the harness at module level.

``tessera bench --model`` drives a tessera that is already running
(:mod:`harness.live`). ``tessera bench --scenario`` serves a scenario file's
workload (``benchmarks/scenarios/*.yaml``: tenants, models, closed or open loop,
bounds) with each of its configurations in turn: tessera itself, its baselines
(raw, dedicated, static partition, FIFO) and the peer servers, on this machine,
and writes one report (JSON, Markdown, PNG plots) to ``benchmarks/results/``.

- ``scenario``: the scenario file, parsed and checked.
- ``driver``: the load generator (closed and open loop, one record a request);
  ``request``: the request a tessera gets for each task; ``progress``.
- ``deploy``: starts a configuration's servers (``servers``: processes;
  ``peers``: the peer servers, whose scripts are in ``benchmarks/peers/``
  and whose venvs ``make bench-peers`` installs); ``raw``: the in-process limit.
- ``probes``: memory and residency sampled while a step runs.
- ``inputs``: the sentences sent; ``machine``: the machine, for each report.
- ``runner`` serves a scenario; ``figures``, ``report`` and ``plots`` turn its
  records into numbers, Markdown and PNGs; ``suite`` ties them to one file.
"""
