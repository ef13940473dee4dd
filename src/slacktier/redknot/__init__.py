"""redknot room."""
