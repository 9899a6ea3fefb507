"""Shared parts of the experiments: data, models, attention choice, metrics, process groups."""
