"""Cluster state shared through Redis: request state, worker registry, cancellation, routing."""
