"""Cluster-level state: store, IAM, placement (single-node: embedded SQLite)."""
