"""The HTTP protocol of libdsec, without I/O: the one place that builds requests.

Every operation is a function returning a ``Call``: what to send and how to parse the
successful answer. The async and the sync client only differ in how they *send* a Call
(the approach httpx itself takes for Client and AsyncClient); ``dsec.sdk._http`` holds
what both senders share (settings, failure translation), so no logic exists twice.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar
from urllib.parse import quote

import httpx
from pydantic import BaseModel, TypeAdapter, ValidationError

from dsec.api.exec import ExecRequest, ExecResult
from dsec.api.fields import SANDBOX_ID_RE, parse_image_ref
from dsec.api.health import HealthInfo
from dsec.api.images import (
    BuildImageRequest,
    ComposeImageRequest,
    ImageConfigSpec,
    ImageInfo,
    PullImageRequest,
    PullResult,
    RegisterVMRequest,
    VMBlobInfo,
)
from dsec.api.sandbox import (
    IDEMPOTENCY_HEADER,
    IDEMPOTENCY_KEY_RE,
    CreateSandboxRequest,
    NetworkRules,
    SandboxInfo,
    SandboxState,
    SandboxStats,
)
from dsec.api.spec import RunArgs
from dsec.api.verify import VerifyMode, VerifyRequest, VerifyResult
from dsec.errors import (
    DSecError,
    InvalidArgument,
    SandboxNotFound,
)
from dsec.sdk._upload import Upload

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)

CONNECT_TIMEOUT = 10.0
_JSON_HEADERS = {"Content-Type": "application/json"}
_OCTET_HEADERS = {"Content-Type": "application/octet-stream"}


@dataclass(frozen=True, slots=True)
class Call(Generic[T]):
    """One HTTP request and the parser of its successful response.

    ``timeout`` None means the client's default; ``upload`` streams a request body.
    """

    method: str
    path: str
    parse: Callable[[httpx.Response], T]
    params: list[tuple[str, str]] | None = None
    content: bytes | None = None
    headers: Mapping[str, str] | None = None
    timeout: httpx.Timeout | None = None
    upload: Upload | None = None


def wait_timeout(seconds: float | None) -> httpx.Timeout:
    """An HTTP timeout slightly above a server-side one, so the server's typed error wins.

    None means no read limit at all (the server owns the operation's lifetime).
    """
    if seconds is None:
        return httpx.Timeout(None, connect=CONNECT_TIMEOUT)
    return httpx.Timeout(seconds * 1.05 + 5.0, connect=CONNECT_TIMEOUT)


# ---- parsing -------------------------------------------------------------------------


def _model(cls: type[M]) -> Callable[[httpx.Response], M]:
    def parse(resp: httpx.Response) -> M:
        try:
            return cls.model_validate_json(resp.content)
        except ValidationError as exc:
            raise _bad_response(resp, exc) from None

    return parse


def _list_of(cls: type[M]) -> Callable[[httpx.Response], list[M]]:
    adapter: TypeAdapter[list[M]] = TypeAdapter(list[cls])  # type: ignore[valid-type]

    def parse(resp: httpx.Response) -> list[M]:
        try:
            return adapter.validate_json(resp.content)
        except ValidationError as exc:
            raise _bad_response(resp, exc) from None

    return parse


def _bytes(resp: httpx.Response) -> bytes:
    return resp.content


def _nothing(_: httpx.Response) -> None:
    return None


def _bad_response(resp: httpx.Response, exc: ValidationError) -> DSecError:
    return DSecError(
        f"unexpected response from {resp.request.method} {resp.request.url.path} "
        f"(is the SDK older than the platform?): {exc.errors()[0].get('msg', exc)}"
    )


def invalid(exc: ValidationError) -> InvalidArgument:
    """A client-side validation failure, worded like the server's."""
    parts = [
        f"{'.'.join(str(p) for p in e['loc']) or 'value'}: "
        + str(e["msg"]).removeprefix("Value error, ")
        for e in exc.errors()[:10]
    ]
    return InvalidArgument("; ".join(parts))


# ---- path helpers --------------------------------------------------------------------


def sandbox_path(sandbox_id: str) -> str:
    """``/v1/sandboxes/<id>``; an id that cannot exist fails locally like a missing one."""
    if not isinstance(sandbox_id, str) or not SANDBOX_ID_RE.match(sandbox_id):
        raise SandboxNotFound(
            f"no sandbox {str(sandbox_id)[:80]!r}: sandbox ids look like 'e0-0123456789abcdef'"
        )
    return f"/v1/sandboxes/{sandbox_id}"


def image_path(ref: str) -> str:
    try:
        name, _ = parse_image_ref(ref)
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None
    if any(part in ("", ".", "..") for part in name.split("/")):
        raise InvalidArgument(f"invalid image reference {ref!r}: bad name segment")
    return "/v1/images/" + quote(ref, safe="/:")


# ---- operations ----------------------------------------------------------------------


def health() -> Call[HealthInfo]:
    return Call("GET", "/v1/health", _model(HealthInfo))


def stats(sandbox_id: str | None = None) -> Call[list[SandboxStats]]:
    params = None if sandbox_id is None else [("sandbox_id", sandbox_id)]
    return Call("GET", "/v1/stats", _list_of(SandboxStats), params=params)


def create_sandbox(
    args: RunArgs, timeout: float, idempotency_key: str | None = None
) -> Call[SandboxInfo]:
    """``idempotency_key``: resending the same create with the same key returns the
    sandbox the first one made instead of a second one (for 24 h)."""
    try:
        body = CreateSandboxRequest(spec=args, timeout=timeout)
    except ValidationError as exc:
        raise invalid(exc) from None
    headers: Mapping[str, str] = _JSON_HEADERS
    if idempotency_key is not None:
        if not isinstance(idempotency_key, str) or not IDEMPOTENCY_KEY_RE.match(idempotency_key):
            raise InvalidArgument(
                f"idempotency_key must be 1-255 characters of A-Z a-z 0-9 . _ : ~ + / = -"
                f" (got {str(idempotency_key)[:80]!r})"
            )
        headers = {**_JSON_HEADERS, IDEMPOTENCY_HEADER: idempotency_key}
    return Call(
        "POST",
        "/v1/sandboxes",
        _model(SandboxInfo),
        content=body.model_dump_json().encode(),
        headers=headers,
        timeout=wait_timeout(timeout),
    )


def get_sandbox(sandbox_id: str) -> Call[SandboxInfo]:
    return Call("GET", sandbox_path(sandbox_id), _model(SandboxInfo))


def list_sandboxes(
    labels: Mapping[str, str] | None = None,
    states: Iterable[SandboxState | str] | None = None,
) -> Call[list[SandboxInfo]]:
    params = [("label", f"{k}={v}") for k, v in (labels or {}).items()]
    if isinstance(states, str):
        states = [states]
    for state in states or ():
        try:
            params.append(("state", SandboxState(state).value))
        except ValueError:
            raise InvalidArgument(
                f"unknown sandbox state {state!r}; one of {[s.value for s in SandboxState]}"
            ) from None
    return Call("GET", "/v1/sandboxes", _list_of(SandboxInfo), params=params)


def stop_sandbox(sandbox_id: str) -> Call[SandboxInfo]:
    return Call("DELETE", sandbox_path(sandbox_id), _model(SandboxInfo))


def _command_body(model: type[M], command: str | list[str], **fields: Any) -> bytes:
    """One command request (exec or verify): fields left at None take the server's
    defaults, then the model decides validity (a typed 422 before anything is sent)."""
    present = {k: v for k, v in fields.items() if v is not None}
    present["env"] = dict(present.get("env") or {})
    try:
        body = model.model_validate({"command": command, **present})
    except ValidationError as exc:
        raise invalid(exc) from None
    return body.model_dump_json(exclude_defaults=True).encode()


def exec_command(
    sandbox_id: str,
    command: str | list[str],
    *,
    timeout: float | None = None,
    env: Mapping[str, str] | None = None,
    workdir: str | None = None,
    user: str | None = None,
    stdin: str | None = None,
    max_output_bytes: int | None = None,
) -> Call[ExecResult]:
    content = _command_body(
        ExecRequest,
        command,
        timeout=timeout,
        env=env,
        workdir=workdir,
        user=user,
        stdin=stdin,
        max_output_bytes=max_output_bytes,
    )
    return Call(
        "POST",
        sandbox_path(sandbox_id) + "/exec",
        _model(ExecResult),
        content=content,
        headers=_JSON_HEADERS,
        timeout=wait_timeout(timeout),
    )


def verify_command(
    sandbox_id: str,
    command: str | list[str],
    *,
    graded: Sequence[str] | None = None,
    mode: VerifyMode = "fresh",
    timeout: float | None = None,
    env: Mapping[str, str] | None = None,
    workdir: str | None = None,
    user: str | None = None,
    stdin: str | None = None,
    max_output_bytes: int | None = None,
) -> Call[VerifyResult]:
    """A grader in a pristine verifier that sees the graded paths as read-only data."""
    content = _command_body(
        VerifyRequest,
        command,
        graded=list(graded) if graded is not None else None,
        mode=mode,
        timeout=timeout,
        env=env,
        workdir=workdir,
        user=user,
        stdin=stdin,
        max_output_bytes=max_output_bytes,
    )
    return Call(
        "POST",
        sandbox_path(sandbox_id) + "/verify",
        _model(VerifyResult),
        content=content,
        headers=_JSON_HEADERS,
        timeout=wait_timeout(timeout or 600.0),
    )


def update_network(sandbox_id: str, rules: Mapping[str, bool]) -> Call[NetworkRules]:
    """PUT the sandbox's new egress rules; they replace the old ones (no merge)."""
    try:
        body = NetworkRules(network_rules=dict(rules))
    except ValidationError as exc:
        raise invalid(exc) from None
    return Call(
        "PUT",
        sandbox_path(sandbox_id) + "/network",
        _model(NetworkRules),
        content=body.model_dump_json().encode(),
        headers=_JSON_HEADERS,
    )


def _check_file_path(path: str) -> str:
    if not isinstance(path, str) or not path.startswith("/") or "\x00" in path:
        raise InvalidArgument(f"path must be an absolute path without NUL bytes, got {path!r}")
    return path


def read_file(sandbox_id: str, path: str) -> Call[bytes]:
    return Call(
        "GET",
        sandbox_path(sandbox_id) + "/files",
        _bytes,
        params=[("path", _check_file_path(path))],
    )


def write_file(sandbox_id: str, path: str, data: bytes | str, *, mode: int) -> Call[None]:
    if isinstance(data, str):
        data = data.encode()
    if not isinstance(data, bytes | bytearray | memoryview):
        raise InvalidArgument(f"data must be bytes or str, got {type(data).__name__}")
    if not 0 <= mode <= 0o7777:
        raise InvalidArgument(f"mode must be a permission value such as 0o644, got {mode!r}")
    return Call(
        "PUT",
        sandbox_path(sandbox_id) + "/files",
        _nothing,
        params=[("path", _check_file_path(path)), ("mode", format(mode, "o"))],
        content=bytes(data),
        headers=_OCTET_HEADERS,
    )


def list_images() -> Call[list[ImageInfo]]:
    return Call("GET", "/v1/images", _list_of(ImageInfo))


def get_image(ref: str) -> Call[ImageInfo]:
    return Call("GET", image_path(ref), _model(ImageInfo))


def remove_image(ref: str) -> Call[ImageInfo]:
    return Call("DELETE", image_path(ref), _model(ImageInfo))


def build_image(
    recipe: str,
    *,
    name: str | None = None,
    rebuild: bool = False,
    timeout: float | None = None,
) -> Call[ImageInfo]:
    if name is not None:
        image_path(name)
    try:
        body = BuildImageRequest.model_validate(
            {"recipe": recipe, "name": name, "rebuild": rebuild}
        )
    except ValidationError as exc:
        raise invalid(exc) from None
    return Call(
        "POST",
        "/v1/images/build",
        _model(ImageInfo),
        content=body.model_dump_json().encode(),
        headers=_JSON_HEADERS,
        timeout=wait_timeout(timeout),
    )


def pull_image(
    ref: str,
    *,
    username: str | None = None,
    password: str | None = None,
    streaming: bool = True,
    timeout: float | None = None,
) -> Call[PullResult]:
    image_path(ref)
    try:
        body = PullImageRequest.model_validate(
            {"ref": ref, "username": username, "password": password, "streaming": streaming}
        )
    except ValidationError as exc:
        raise invalid(exc) from None
    if (username is None) != (password is None):
        raise InvalidArgument("give both a username and a password, or neither")
    return Call(
        "POST",
        "/v1/images/pull",
        _model(PullResult),
        content=body.model_dump_json().encode(),
        headers=_JSON_HEADERS,
        timeout=wait_timeout(timeout),
    )


def import_image(
    ref: str, upload: Upload, fmt: str = "auto", *, timeout: float | None = None
) -> Call[ImageInfo]:
    image_path(ref)
    if fmt not in ("auto", "tar", "oci"):
        raise InvalidArgument(f"format must be one of auto, tar, oci; got {fmt!r}")
    headers = dict(_OCTET_HEADERS)
    if upload.size is not None:
        headers["Content-Length"] = str(upload.size)
    return Call(
        "PUT",
        "/v1/images/import",
        _model(ImageInfo),
        params=[("ref", ref), ("format", fmt)],
        headers=headers,
        timeout=wait_timeout(timeout),
        upload=upload,
    )


def add_vm_blob(upload: Upload, *, timeout: float | None = None) -> Call[VMBlobInfo]:
    """One file of a VM image (disk, kernel, initrd) into the layer store."""
    headers = dict(_OCTET_HEADERS)
    if upload.size is not None:
        headers["Content-Length"] = str(upload.size)
    return Call(
        "PUT",
        "/v1/images/vm-blobs",
        _model(VMBlobInfo),
        headers=headers,
        timeout=wait_timeout(timeout),
        upload=upload,
    )


def compose_image(ref: str, layers: list[str], config: ImageConfigSpec | None) -> Call[ImageInfo]:
    image_path(ref)
    try:
        body = ComposeImageRequest(ref=ref, layers=layers, config=config or ImageConfigSpec())
    except ValidationError as exc:
        raise invalid(exc) from None
    return Call(
        "POST",
        "/v1/images/compose",
        _model(ImageInfo),
        content=body.model_dump_json().encode(),
        headers=_JSON_HEADERS,
    )


def register_vm(
    ref: str,
    disk: str,
    *,
    kernel: str | None = None,
    initrd: str | None = None,
    cmdline: str | None = None,
) -> Call[ImageInfo]:
    image_path(ref)
    try:
        body = RegisterVMRequest(ref=ref, disk=disk, kernel=kernel, initrd=initrd, cmdline=cmdline)
    except ValidationError as exc:
        raise invalid(exc) from None
    return Call(
        "POST",
        "/v1/images/vm",
        _model(ImageInfo),
        content=body.model_dump_json().encode(),
        headers=_JSON_HEADERS,
    )
