"""Images: content-addressed EROFS layers, importers, builders and the host mount cache.

Entry point: :class:`dsec.images.images.Images` (implements
:class:`dsec.images.service.ImageService`).
"""
