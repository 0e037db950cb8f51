"""libdsec: one Python SDK for every DSec backend (async ``DSecClient``, sync twin).

Depends only on dsec.api, dsec.errors, dsec.config, httpx and pydantic, so it installs
without the server's dependencies.
"""

from dsec.sdk._upload import UploadProgress, UploadSource
from dsec.sdk.client import DSecClient, Sandbox
from dsec.sdk.datapath import CommandResult, CommandStream, OutputChunk, Process, Pty, Session
from dsec.sdk.sync import DSecSyncClient, SyncSandbox
from dsec.sdk.sync_datapath import SyncCommandStream, SyncProcess, SyncPty, SyncSession

__all__ = [
    "CommandResult",
    "CommandStream",
    "DSecClient",
    "DSecSyncClient",
    "OutputChunk",
    "Process",
    "Pty",
    "Sandbox",
    "Session",
    "SyncCommandStream",
    "SyncProcess",
    "SyncPty",
    "SyncSandbox",
    "SyncSession",
    "UploadProgress",
    "UploadSource",
]
