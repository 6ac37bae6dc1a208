"""What tests import besides fixtures: faults to cause on purpose (a TCP proxy to cut, a Redis to restart)."""
