"""workloads room."""
