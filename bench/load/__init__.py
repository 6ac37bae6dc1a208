"""The load generator's parts: what to send and when (pure), sending it, and summing it up."""
