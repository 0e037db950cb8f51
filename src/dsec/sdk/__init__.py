"""libdsec: one Python SDK for every DSec backend (async ``DSecClient``, sync twin).

Depends only on dsec.model, dsec.errors, dsec.config, httpx and pydantic, so it installs
without the server's dependencies.
"""

from dsec.sdk._upload import UploadProgress, UploadSource
from dsec.sdk.client import DSecClient, Sandbox
from dsec.sdk.sync import DSecSyncClient, SyncSandbox

__all__ = [
    "DSecClient",
    "DSecSyncClient",
    "Sandbox",
    "SyncSandbox",
    "UploadProgress",
    "UploadSource",
]
