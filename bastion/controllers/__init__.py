"""Built-in controllers."""
