"""Keep the lazy loader's registry token fresh.

A registry's token service hands out bearer tokens that expire (``expires_in``; 60 s
when it does not say, per the Docker token spec), while dsec-lazyfs reads layers for as
long as the sandboxes on them run. The platform owns the credentials, so it renews the
token: at half of each token's remaining life it earns a new one from the store and
rewrites the daemon's auth file (LazyDaemon.set_authorization: atomic rename, 0600, in
the root-only lazy directory). The daemon re-reads that file when a range request is
answered 401, and retries once. A store whose header does not expire (basic auth, our
own store server's fixed token, a directory) needs nothing of this.
"""

from __future__ import annotations

import asyncio
import logging
import time

from dsec.errors import DSecError
from dsec.images.lazy.daemon import LazyDaemon
from dsec.images.remote.client import RemoteStore

log = logging.getLogger(__name__)

MIN_DELAY = 0.5  # never spin on a token that is (nearly) expired already
RETRY_DELAY = 5.0  # the store or its token service failed: try again this soon
IDLE_CHECK = 300.0  # a header that does not expire: look again this rarely


def renew_delay(expires: float, now: float) -> float:
    """Seconds until the next renewal: half of the token's remaining life."""
    return max(MIN_DELAY, (expires - now) / 2)


async def keep_fresh(remote: RemoteStore, daemon: LazyDaemon) -> None:
    """Renew the daemon's Authorization header before it expires, until cancelled."""
    while True:
        expires = remote.lazy_authorization_expires()
        if expires is None:
            await asyncio.sleep(IDLE_CHECK)
            continue
        await asyncio.sleep(renew_delay(expires, time.monotonic()))
        try:
            value = await remote.lazy_authorization()
            if value:
                await asyncio.to_thread(daemon.set_authorization, value)
                log.debug("renewed the lazy loader's layer store token")
        except (DSecError, OSError) as exc:
            log.warning("cannot renew the layer store token of the lazy loader: %s", exc)
            await asyncio.sleep(min(RETRY_DELAY, max(MIN_DELAY, expires - time.monotonic())))
