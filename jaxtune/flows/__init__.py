"""Prefect flows: they only wire stages together."""
