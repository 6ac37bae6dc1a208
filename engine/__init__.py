"""Model execution: weight loading, native Llama over a paged KV cache, sampling, the step loop.

Knows nothing of HTTP, tenants' keys or money: it emits plain events.
"""

import os

# An idle OpenMP worker of torch spins ~0.1 ms (not libgomp's ~3 ms) before it sleeps: long
# enough to bridge one step's ops, short enough to leave the core to the event loop between
# steps (docs/performance.md). libgomp reads it once, when torch is first imported, hence here.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")

# oneDNN keeps a compiled primitive, with its own scratch memory, per row count it has seen
# (1024 by default): prefill chunks of every length grew the process without bound. Both
# caches (torch's ideep, oneDNN's own) read their capacity when torch is first imported.
os.environ.setdefault("LRU_CACHE_CAPACITY", "32")
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "32")
