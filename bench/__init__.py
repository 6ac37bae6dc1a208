"""Benchmarks, grouped by what they run against (mini-sglang's benchmark/{offline,online} is the model).

- ``sim/``: the real scheduler on a virtual clock and a fitted step-cost model (no engine, seconds to run).
- ``offline/``: the engine (or billing) in this process, against peers where there is one.
- ``live/``: a running `tiergate serve` over HTTP (``live/server.py`` starts and stops it).
- ``kernels/``: one kernel or op alone, A/B against the form it replaced.
- ``peers/``: the runners of the peers (HF transformers, llama.cpp) and of tiergate for like-for-like runs.
- ``load/``: the load generator (``load/loadgen.py``) and its parts.
- ``common/``: what all share: the machine, percentiles, paths, the report tail, model files, workloads.

``python -m bench.run_all`` (`make bench`) runs them into bench/RESULTS.md; each is also a module
to run alone, ``python -m bench.KIND.NAME --help``.
"""
