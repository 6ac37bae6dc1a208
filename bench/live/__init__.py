"""Benches against a running `tiergate serve` over HTTP: SLOs, fair share, the batch tier, hostile tenants, chaos."""
