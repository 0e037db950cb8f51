"""Cluster mode: apiserver, edges and watcher as separate processes (docs/CLUSTER.md).

Their composition roots are in dsec.roots (apiserver, edge, watcher)."""
