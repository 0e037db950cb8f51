"""Composition roots: the only places where the platform's processes are wired.

Each server process has one root that constructs its services once, hands them to
the components that use them, and owns their lifetimes (start, close) in one place:

- ``platform``: `dsec up`, the single-node platform (edge, control store, layer
  store and apiserver in one process);
- ``edge``: `dsec edge --join`, a cluster edge (the single-node root plus membership);
- ``apiserver``: `dsec apiserver`, a cluster apiserver over every edge;
- ``watcher``: `dsec watcher`, the cluster's prober.

``serving`` is the HTTP server and event loop they share. Everything below the roots
is handed what it needs and constructs no sibling service itself, so replacing a
backend, a store or a fan-out is an edit here, not a hunt through the packages.
"""
