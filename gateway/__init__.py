"""HTTP edge of tiergate: OpenAI-compatible API, auth, rate limits, admission (429), SSE, CLI.

The only package that imports everything: it wires engine, billing and lora_pool together.
"""
