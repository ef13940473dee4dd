"""engine room."""
