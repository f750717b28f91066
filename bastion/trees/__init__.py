"""Built-in trees."""
