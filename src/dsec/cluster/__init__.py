"""Cluster mode: apiserver, edges and watcher as separate processes (docs/CLUSTER.md)."""
