"""FnCall: stateless calls from warm zygote pools.

Not a ``dsec.backends.Backend``: an FnCall sandbox lives for one call and has no record,
lifecycle or data path on the edge, so it is its own service beside the edge.
"""
