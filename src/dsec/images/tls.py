"""The one TLS trust setting of the image side's HTTPS clients.

The OCI layer store (ocistore), the image pull client (images.oci) and the lazy loader
(dsec-lazyfs, ``--ca-file``) all verify a registry against the same certificates: the
system CA store, or only the PEM bundle ``registry_ca_file`` names
(``DSEC_REGISTRY_CA_FILE`` / ``dsec up --registry-ca-file``) for a team's private CA.
Python uses an ``ssl`` context built from the system store rather than httpx's default
(certifi), so that the platform and the C daemon trust exactly the same roots.
Verification is never turned off: a plain-HTTP registry is named so (``oci+http://``,
``--insecure-registry``) instead.
"""

from __future__ import annotations

import ssl
from pathlib import Path

from dsec.errors import InvalidArgument


def tls_context(ca_file: Path | None) -> ssl.SSLContext:
    """A verifying client context: the system CA store, or only ``ca_file``."""
    try:
        return ssl.create_default_context(cafile=str(ca_file) if ca_file is not None else None)
    except (OSError, ssl.SSLError) as exc:
        raise InvalidArgument(
            f"registry CA file {ca_file}: cannot load it as PEM certificates ({exc})"
        ) from None


def describe_failure(exc: BaseException) -> str:
    """A connection error, said plainly when it is a certificate the client refused."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ssl.SSLCertVerificationError):
            return (
                f"its TLS certificate is not trusted ({seen.verify_message or seen}); "
                "trust its CA with DSEC_REGISTRY_CA_FILE / --registry-ca-file"
            )
        seen = seen.__cause__ or seen.__context__
    return str(exc) or type(exc).__name__
