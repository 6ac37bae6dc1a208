"""What every bench shares: the machine it ran on, percentiles, the report tail, paths, model files and workloads."""
