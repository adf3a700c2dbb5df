"""Prefect flows: they only wire stages together.

May import: jaxtune.config, jaxtune.errors, jaxtune.artifacts, jaxtune.checks, jaxtune.host, jaxtune.rewards, \
jaxtune.runtime.devices, jaxtune.tasks, jaxtune.tracking
"""
