"""Harbor's lifecycle calls on our environment, outside a trial (run in .venv-harbor by
tests/test_harbor_integration.py): a start cancelled while the platform creates the
sandbox, then ``stop``, must leave no sandbox; ``stop`` again is a no-op.

Usage: python -m tests.harbor_lifecycle IMAGE  (DSEC_URL / DSEC_API_KEY set). Prints
one JSON line: what the cancelled start had got to, and the sandboxes left."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import tempfile
from pathlib import Path

from harbor.models.task.config import EnvironmentConfig
from harbor.models.trial.paths import TrialPaths

from dsec.errors import SandboxNotFound
from dsec.integrations.harbor import DSecEnvironment
from dsec.sdk.client import DSecClient


async def main(image: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "environment").mkdir()
        session = "lifecycle__" + Path(tmp).name[-8:]
        env = DSecEnvironment(
            environment_dir=Path(tmp) / "environment",
            environment_name="lifecycle",
            session_id=session,
            trial_paths=TrialPaths(Path(tmp) / "trial"),
            task_env_config=EnvironmentConfig(docker_image=image),
        )
        mine = {"harbor.session": session}
        async with DSecClient() as probe:
            start = asyncio.create_task(env.start(force_build=False))
            for _ in range(3000):  # until the platform has it (creating or running)
                if await probe.list_sandboxes(labels=mine) or start.done():
                    break
                await asyncio.sleep(0.01)
            start.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await start
            try:  # which path stop() takes: the sandbox it knows, or a label sweep
                got_reply = bool(env.sandbox.id)
            except SandboxNotFound:
                got_reply = False
            await env.stop(delete=True)
            await env.stop(delete=True)
            left = [s.id for s in await probe.list_sandboxes(labels=mine)]
    print(json.dumps({"create_reply_seen": got_reply, "left": left}))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
