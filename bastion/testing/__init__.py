"""Helpers for testing bastion components (tiny models, contract kit for plugin authors)."""
