"""Model execution: weight loading, native Llama over a paged KV cache, sampling, the step loop.

Knows nothing of HTTP, tenants' keys or money: it emits plain events.
"""

import os

# How long an idle OpenMP worker of torch spins before it sleeps. libgomp reads it once, when
# torch is first imported, hence here, before any module of this package imports torch (a
# process that imported torch earlier keeps the default). The default, about 3 ms, left the
# engine thread's worker spinning on a core after every step, where the event loop and other
# processes needed it: in one gateway bench run of three or four, a direct engine call took
# 3.4 ms instead of 0.8 (p99 10 ms); not once in ten runs with 10000. 10000 spins (~0.1 ms)
# still bridge the gaps between the ops of one step: a 2-thread decode step of the bundled
# model takes 28.8 ms (28.4 with the default, 49 with 1000), and c=8/c=32 throughput is the same.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")

# oneDNN (the packed projections, engine/packed_linear.py) keeps a compiled primitive, with its
# own scratch memory, for every row count it has seen, up to 1024 of them by default: prefill
# chunks of every length grew the process by about 1.2 MB per new row count. Both caches on the
# way (torch's ideep and oneDNN's own) read their capacity once, when torch is first imported.
os.environ.setdefault("LRU_CACHE_CAPACITY", "32")
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "32")
