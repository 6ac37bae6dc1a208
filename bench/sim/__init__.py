"""Simulations: the real scheduler on a virtual clock, each step timed by a step-cost model (stated or fitted)."""
