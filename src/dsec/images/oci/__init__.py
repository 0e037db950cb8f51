"""Pulling images from OCI registries (the distribution protocol over httpx).

``reference`` parses image references, ``auth`` finds credentials and answers the
registry's challenges, ``client`` speaks the protocol (manifests, indexes, blobs),
``convert`` turns one registry layer into one EROFS layer, ``pull`` ties them to the
host's Images.
"""
