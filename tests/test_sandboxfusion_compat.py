"""SandboxFusion drop-in: the unmodified ``sandbox-fusion`` client from PyPI against a
real platform's FnCall backend (toolchain image: python3, bash, g++, node).

The client retries any failure with backoff, so every call here passes
``max_attempts=1``: a refusal must be seen at once, not after five tries."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Iterator

import httpx
import pytest
from sandbox_fusion import RunCodeRequest, RunCodeResponse, RunStatus, run_code
from sandbox_fusion.models import CommandRunStatus

from dsec import DSecSyncClient
from dsec.fncall.toolchain import TOOLCHAIN_REF, ensure_toolchain_tree
from tests.conftest import PlatformProcess, platform_process

pytestmark = [pytest.mark.root]


@pytest.fixture(scope="module")
def endpoint() -> Iterator[tuple[PlatformProcess, str]]:
    with platform_process() as plat:
        tree = asyncio.run(ensure_toolchain_tree())
        with DSecSyncClient(plat.url, plat.api_key, timeout=600) as c:
            c.import_image(TOOLCHAIN_REF, tree, timeout=600)
        host = plat.url.removeprefix("http://")
        yield plat, f"http://dsec:{plat.api_key}@{host}"


def _run(endpoint: str, **fields: object) -> RunCodeResponse:
    return run_code(RunCodeRequest(**fields), endpoint=endpoint, max_attempts=1)


def test_python_bash_cpp_and_node_run(endpoint: tuple[PlatformProcess, str]) -> None:
    url = endpoint[1]
    cases = {
        "python": "import sys; print(sys.stdin.read().upper())",
        "bash": 'read x; echo "${x^^}"',
        "cpp": "#include <iostream>\n#include <string>\nint main(){std::string s;"
        "std::cin>>s;for(auto&c:s)c=toupper(c);std::cout<<s<<std::endl;}",
        "nodejs": "process.stdin.on('data', d => console.log(String(d).trim().toUpperCase()))",
    }
    for language, code in cases.items():
        r = _run(url, language=language, code=code, stdin="abc\n")
        assert r.status == RunStatus.Success, (language, r)
        assert r.run_result.status == CommandRunStatus.Finished
        assert r.run_result.return_code == 0
        assert r.run_result.stdout.strip() == "ABC", (language, r)
        if language == "cpp":
            assert r.compile_result is not None and r.compile_result.return_code == 0


def test_statuses_are_sandboxfusions(endpoint: tuple[PlatformProcess, str]) -> None:
    url = endpoint[1]
    r = _run(url, language="python", code="import sys; print('x'); sys.exit(3)")
    assert r.status == RunStatus.Failed
    assert r.run_result.status == CommandRunStatus.Finished
    assert (r.run_result.return_code, r.run_result.stdout) == (3, "x\n")
    r = _run(url, language="python", code="while True: pass", run_timeout=1)
    assert r.status == RunStatus.Failed
    assert r.run_result.status == CommandRunStatus.TimeLimitExceeded
    r = _run(url, language="cpp", code="int main( { return 0; }")
    assert r.status == RunStatus.Failed and r.run_result is None
    assert r.compile_result.status == CommandRunStatus.Finished
    assert r.compile_result.return_code != 0 and "error" in r.compile_result.stderr
    r = _run(url, language="python", code="import os; os.kill(os.getpid(), 9)")
    assert r.status == RunStatus.Failed and r.run_result.return_code == -9


def test_files_are_base64_and_verls_payload_works(endpoint: tuple[PlatformProcess, str]) -> None:
    plat, url = endpoint
    data = base64.b64encode(b"41\n").decode()
    r = _run(
        url, language="python", code="print(int(open('in.txt').read()) + 1)", files={"in.txt": data}
    )
    assert r.status == RunStatus.Success and r.run_result.stdout == "42\n"
    # verl's reward path posts this JSON itself (requests.post(url/run_code, json=...)).
    payload = {
        "code": "print(input())",
        "stdin": "hi",
        "language": "python",
        "compile_timeout": 10,
        "run_timeout": 10,
        "memory_limit_MB": 1024,
    }
    resp = httpx.post(f"{plat.url}/run_code", json=payload, auth=("dsec", plat.api_key))
    assert resp.status_code == 200, resp.text
    assert resp.json()["status"] == "Success" and resp.json()["run_result"]["stdout"] == "hi\n"


def test_refusals_are_typed(endpoint: tuple[PlatformProcess, str]) -> None:
    plat, url = endpoint
    body = {"code": "print(1)", "language": "python"}
    for auth in (None, ("dsec", "wrong"), ("dsec", "")):
        resp = httpx.post(f"{plat.url}/run_code", json=body, auth=auth)
        assert resp.status_code == 401, resp.text
        assert resp.json()["error"]["code"] == "unauthenticated"
    headers = {"Authorization": f"Bearer {plat.api_key}"}
    resp = httpx.post(f"{plat.url}/run_code", json=body, headers=headers)
    assert resp.status_code == 200 and resp.json()["status"] == "Success"
    bad = [
        {"code": "x", "language": "lean"},
        {"code": "x", "language": "python", "fetch_files": ["/etc/passwd"]},
        {"code": "x", "language": "python", "files": {"a": "%%%not base64"}},
        {"code": "x", "language": "python", "run_timeout": -1},
        {"language": "python"},
    ]
    for b in bad:
        resp = httpx.post(f"{plat.url}/run_code", json=b, headers=headers)
        assert 400 <= resp.status_code < 500, (b, resp.text)
        assert resp.json()["error"]["message"], resp.text
    with pytest.raises(Exception, match="lean"):
        _run(url, language="lean", code="x")
    resp = httpx.post(f"{plat.url}/run_jupyter", json={"cells": ["1"]}, headers=headers)
    assert resp.status_code == 501 and "run_jupyter" in resp.json()["error"]["message"]
    # A file path that escapes the run's directory is the FnCall backend's own refusal.
    data = base64.b64encode(b"x").decode()
    resp = httpx.post(
        f"{plat.url}/run_code",
        headers=headers,
        json={"code": "print(1)", "language": "python", "files": {"../../etc/x": data}},
    )
    assert 400 <= resp.status_code < 500, resp.text
