"""cache room."""
