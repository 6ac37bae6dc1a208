"""System of record: tenants, tiers, API keys, adapter grants, the usage ledger and GPU-second reports.

Knows nothing of torch, HTTP or the engine's classes: engine events are read duck-typed.
"""
