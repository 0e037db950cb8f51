"""An in-memory backend: sandboxes as Python objects, for conformance tests and unit
tests of the edge's state machine without root, crun or images (dsec.backends.memory.backend)."""
