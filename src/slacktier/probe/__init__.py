"""probe room."""
