"""Benches of the engine (and billing's report) in this process: no HTTP, peers run on the same weights."""
