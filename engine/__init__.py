"""Model execution: weight loading, native Llama over a paged KV cache, sampling, the step loop.

Knows nothing of HTTP, tenants' keys or money: it emits plain events.
"""
