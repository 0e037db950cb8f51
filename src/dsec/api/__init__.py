"""The wire: every request and reply model that crosses a process boundary.

The SDK, the apiserver, the edges and the cluster speak only these shapes, so they
cannot disagree about a field. Modules by topic (``spec`` for run specs, ``sandbox``,
``exec``, ``files``, ``datapath``, ``layers``, ...); ``base`` holds ``Strict`` and
``Reply``, the one place that decides wire compatibility. This package depends on
nothing of ours but dsec.errors, so importing it (and the SDK on top of it) stays light.
This ``__init__`` imports nothing: importing one topic must not load the others.
"""
