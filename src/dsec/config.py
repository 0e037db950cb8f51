"""Where things live and how clients find the platform.

Resolution order for clients: explicit argument, then ``DSEC_URL`` / ``DSEC_API_KEY``,
then ``~/.config/dsec/config.json`` (written by ``dsec up``), then the default URL.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from dsec.errors import InvalidArgument

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8470
DEFAULT_URL = f"http://{DEFAULT_HOST}:{DEFAULT_PORT}"
DEFAULT_DATA_DIR = Path(os.environ.get("DSEC_DATA_DIR", "/var/lib/dsec"))


# -- DSEC_* settings: one parser per kind of value --------------------------------------
# An operator's typo (DSEC_SWAP_GB=8G, DSEC_TOKEN_TTL=-5) stops `dsec up` with one line
# that names the variable, what it takes and what it got (a typed InvalidArgument, which
# the CLI prints without a traceback), never a ValueError from inside a dataclass default
# or a value silently taken as something else. Unset or empty means the default.

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})
N = TypeVar("N", int, float)


def _raw(name: str) -> str | None:
    value = os.environ.get(name, "").strip()
    return value or None


def _bad(name: str, wanted: str, value: str) -> InvalidArgument:
    return InvalidArgument(f"{name} must be {wanted}, got {value[:80]!r}")


def _number(
    name: str, parse: Callable[[str], N], kind: str, minimum: N | None, maximum: N | None
) -> N | None:
    """``name`` read with ``parse`` (int or float), finite and in [minimum, maximum];
    None when unset. ``kind`` names what it takes in the error ("a whole number")."""
    raw = _raw(name)
    if raw is None:
        return None
    try:
        value = parse(raw)
    except ValueError:
        raise _bad(name, kind, raw) from None
    if not math.isfinite(value):
        raise _bad(name, f"a finite {kind.removeprefix('a ')}", raw)
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        lo = "" if minimum is None else f" >= {minimum:g}"
        hi = "" if maximum is None else f" <= {maximum:g}"
        raise _bad(name, f"{kind}{lo}{' and' if lo and hi else ''}{hi}", raw)
    return value


def env_int(name: str, default: int, *, minimum: int | None = 0, maximum: int | None = None) -> int:
    """``name`` as a whole number in [minimum, maximum] (``default`` when unset)."""
    value = _number(name, int, "a whole number", minimum, maximum)
    return default if value is None else value


def env_optional_int(
    name: str, *, minimum: int | None = 0, maximum: int | None = None
) -> int | None:
    """``name`` as a whole number in [minimum, maximum], or None when unset."""
    return _number(name, int, "a whole number", minimum, maximum)


def env_float(
    name: str, default: float, *, minimum: float | None = 0.0, maximum: float | None = None
) -> float:
    """``name`` as a finite number in [minimum, maximum] (``default`` when unset)."""
    value = _number(name, float, "a number", minimum, maximum)
    return default if value is None else value


def env_flag(name: str, default: bool) -> bool:
    """``name`` as on/off: 1/true/yes/on or 0/false/no/off (``default`` when unset)."""
    raw = _raw(name)
    if raw is None:
        return default
    if raw.lower() in _TRUE:
        return True
    if raw.lower() in _FALSE:
        return False
    raise _bad(name, "1 or 0 (true/false, yes/no, on/off)", raw)


def client_config_path() -> Path:
    base = Path(os.environ.get("XDG_CONFIG_HOME", Path.home() / ".config"))
    return base / "dsec" / "config.json"


# Where a platform keeps its own pause swap under its data dir (dsec.resources.swap
# tells these areas from the operator's by it).
PLATFORM_SWAP = ("swap", "pause.swap")


@dataclass(frozen=True)
class ClientConfig:
    url: str
    api_key: str | None


def load_client_config(url: str | None = None, api_key: str | None = None) -> ClientConfig:
    saved: dict[str, str] = {}
    path = client_config_path()
    if path.is_file():
        try:
            loaded = json.loads(path.read_text())
            if isinstance(loaded, dict):
                saved = {k: str(v) for k, v in loaded.items()}
        except (OSError, ValueError):
            saved = {}
    return ClientConfig(
        url=(url or os.environ.get("DSEC_URL") or saved.get("url") or DEFAULT_URL).rstrip("/"),
        api_key=api_key or os.environ.get("DSEC_API_KEY") or saved.get("api_key"),
    )


def save_client_config(url: str, api_key: str) -> Path:
    path = client_config_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump({"url": url, "api_key": api_key}, fh)
    os.replace(tmp, path)
    return path


def parse_mirrors(text: str) -> dict[str, list[str]]:
    """``"docker.io=http://m1:5000,docker.io=https://m2,reg.io=https://m3"`` -> registry
    -> mirror base URLs, in order."""
    out: dict[str, list[str]] = {}
    for item in text.split(","):
        registry, sep, url = item.strip().partition("=")
        if not item.strip():
            continue
        if not sep or not registry or not url.startswith(("http://", "https://")):
            raise ValueError(f"invalid registry mirror {item!r}: expected registry=http(s)://host")
        out.setdefault(registry, []).append(url.rstrip("/"))
    return out


@dataclass
class PlatformConfig:
    """Settings of one embedded platform process (`dsec up`)."""

    data_dir: Path = DEFAULT_DATA_DIR
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    api_key: str | None = None
    # Unique per host: empty = derived from the machine id and the data dir, and kept
    # in <data dir>/edge_id (dsec.edge.identity); dsec.roots.platform fills it in.
    edge_id: str = field(default_factory=lambda: os.environ.get("DSEC_EDGE_ID", ""))
    runtime: str = "crun"
    # Backends to run (`dsec up --backends`, DSEC_BACKENDS=container,...); None: every
    # backend whose host requirements are met (dsec.backends.registry).
    backends: list[str] | None = field(
        default_factory=lambda: (
            [b for b in os.environ["DSEC_BACKENDS"].split(",") if b.strip()]
            if os.environ.get("DSEC_BACKENDS")
            else None
        )
    )
    # Admission (dsec.edge.admission): the sandbox-count limit is derived from what the
    # host holds (dsec.resources.capacity) unless DSEC_MAX_SANDBOXES sets it.
    max_sandboxes: int | None = field(
        default_factory=lambda: env_optional_int("DSEC_MAX_SANDBOXES")
    )
    # Host memory times this is what admission commits by limits, a backstop (a
    # container counts its limit; a VM, whose guest RAM stays resident, counts at full
    # weight whatever this is). Admission is by measured use first.
    memory_overcommit: float = field(
        default_factory=lambda: env_float("DSEC_MEMORY_OVERCOMMIT", 32)
    )
    # Host cores times this bounds the sum of CPU limits; 0 (default): CPU, being
    # compressible (QoS classes share it), is not admitted by.
    cpu_overcommit: float = field(default_factory=lambda: env_float("DSEC_CPU_OVERCOMMIT", 0))
    # Host memory PSI ("some" avg10, percent) at which admission refuses, once the idle
    # reclaimer could not bring it down.
    admission_pressure: float = field(
        default_factory=lambda: env_float("DSEC_ADMISSION_PRESSURE", 60, maximum=100)
    )
    # Host memory one idle sandbox costs (kernel and user) apart from its memory cgroup's
    # shrinker map, which the derived count limit adds itself (dsec.resources.capacity).
    sandbox_host_cost_kb: int = field(
        default_factory=lambda: env_int("DSEC_SANDBOX_HOST_COST_KB", 704, minimum=1)
    )
    # fds the edge holds per idle sandbox (measured: 1, dsec.resources.capacity).
    sandbox_edge_fds: int = field(
        default_factory=lambda: env_int("DSEC_SANDBOX_EDGE_FDS", 1, minimum=1)
    )
    # Idle memory reclaim (dsec.edge.idle): a running sandbox with no data-path
    # activity for this many seconds gives back its page cache (0: never); under host
    # memory pressure above DSEC_RECLAIM_PRESSURE (PSI some avg10, percent) idle
    # sandboxes' anonymous memory goes to swap too, longest idle first.
    idle_reclaim_seconds: float = field(
        default_factory=lambda: env_float("DSEC_IDLE_RECLAIM_SECONDS", 300)
    )
    reclaim_pressure: float = field(
        default_factory=lambda: env_float("DSEC_RECLAIM_PRESSURE", 10, maximum=100)
    )
    # Warm sandboxes (dsec.edge.warmpool): after a create, this many containers of its
    # shape are started ahead for the next create of that shape (0: none), for the last
    # DSEC_WARM_SHAPES shapes asked for, each shape until DSEC_WARM_IDLE_SECONDS pass
    # without a create of it. On by default (one a shape): a create that finds one costs
    # about half a raw `crun run` instead of 1.5 of them (README, issue 19). They are
    # kept only while the edge is in use: DSEC_WARM_GRACE_SECONDS after its last live
    # sandbox ended, every warm one goes, so an edge whose sandboxes were all stopped
    # holds nothing started ahead (no quota group, cgroup or layer) a few seconds later.
    warm_per_shape: int = field(
        default_factory=lambda: env_int("DSEC_WARM_POOL", 1, minimum=0, maximum=64)
    )
    warm_shapes: int = field(
        default_factory=lambda: env_int("DSEC_WARM_SHAPES", 4, minimum=1, maximum=256)
    )
    warm_idle_seconds: float = field(
        default_factory=lambda: env_float("DSEC_WARM_IDLE_SECONDS", 600, minimum=1)
    )
    warm_grace_seconds: float = field(
        default_factory=lambda: env_float("DSEC_WARM_GRACE_SECONDS", 5, minimum=0)
    )
    # Resume prefetch: a resumed sandbox's swapped-out memory is read back ahead
    # (MADV_WILLNEED through process_madvise), DSEC_RESUME_PREFETCH=0 turns it off.
    resume_prefetch: bool = field(default_factory=lambda: env_flag("DSEC_RESUME_PREFETCH", True))
    # Host tuning for fast sandbox starts (cgroup2 favordynmods); DSEC_TUNE_HOST=0 skips.
    tune_host: bool = field(default_factory=lambda: env_flag("DSEC_TUNE_HOST", True))
    # Lifetime of data-path tokens (seconds); the SDK renews them before they expire.
    token_ttl: float = field(default_factory=lambda: env_float("DSEC_TOKEN_TTL", 3600, minimum=1))

    # Shared layer store (http://host:port of `dsec store serve`, or a shared directory);
    # None = the local directory only. Lazily loaded layers are cached on this host
    # up to layer_cache_bytes (least recently used unused layers are evicted).
    layer_store: str | None = field(default_factory=lambda: os.environ.get("DSEC_LAYER_STORE"))
    layer_store_token: str | None = field(
        default_factory=lambda: os.environ.get("DSEC_LAYER_STORE_TOKEN")
    )
    layer_cache_bytes: int = field(
        default_factory=lambda: env_int("DSEC_LAYER_CACHE_BYTES", 20 << 30)
    )
    # Where built-in recipes keep their finished trees (debian-python's debootstrap);
    # unset: <data dir>/images/cache. DSEC_BUILD_CACHE=/path shares one between the data
    # dirs of a host (several platforms, a test session): one debootstrap, then every
    # build is only mkfs.erofs. Builders take a file lock in it, so sharing is safe.
    build_cache_dir: Path | None = field(
        default_factory=lambda: (
            Path(os.environ["DSEC_BUILD_CACHE"]) if os.environ.get("DSEC_BUILD_CACHE") else None
        )
    )
    # OCI registries (dsec image pull): a Docker config.json with credentials; hosts
    # (host:port) reached over plain HTTP, only those named (--insecure-registry); and
    # mirrors tried before a registry ("docker.io=http://mirror:5000,reg.io=https://m").
    registry_auth_file: Path | None = field(
        default_factory=lambda: (
            Path(os.environ["DSEC_REGISTRY_AUTH_FILE"])
            if os.environ.get("DSEC_REGISTRY_AUTH_FILE")
            else None
        )
    )
    # PEM CA bundle that HTTPS registries are verified against instead of the system
    # CA store: image pulls, the oci:// layer store and its lazy loader alike.
    registry_ca_file: Path | None = field(
        default_factory=lambda: (
            Path(os.environ["DSEC_REGISTRY_CA_FILE"])
            if os.environ.get("DSEC_REGISTRY_CA_FILE")
            else None
        )
    )
    insecure_registries: list[str] = field(
        default_factory=lambda: [
            h.strip()
            for h in os.environ.get("DSEC_INSECURE_REGISTRIES", "").split(",")
            if h.strip()
        ]
    )
    registry_mirrors: dict[str, list[str]] = field(
        default_factory=lambda: parse_mirrors(os.environ.get("DSEC_REGISTRY_MIRRORS", ""))
    )
    # Seconds a chunk fetch may take before the read inside the sandbox fails with EIO.
    lazy_fetch_timeout: int = field(
        default_factory=lambda: env_int("DSEC_LAZY_FETCH_TIMEOUT", 10, minimum=1)
    )
    # seccomp allow-list profile in every container (DSEC_SECCOMP=0 turns it off, for
    # measuring its cost only); DSEC_SECCOMP_NOTIFY=0 keeps the profile but refuses the
    # dangerous calls in the kernel alone, without recording them.
    seccomp: bool = field(default_factory=lambda: env_flag("DSEC_SECCOMP", True))
    seccomp_notify: bool = field(default_factory=lambda: env_flag("DSEC_SECCOMP_NOTIFY", True))
    # Size of the sandboxes' writable-disk file system (a sparse btrfs image with one
    # quota group per sandbox, see dsec.resources.disk), fixed when first created.
    # Unset: half the free space below the data dir, at most 512 GiB. 0: no disk limits.
    sandbox_disk_gb: int | None = field(
        default_factory=lambda: env_optional_int("DSEC_SANDBOX_DISK_GB")
    )

    # Preallocate the sandbox disk image (dsec.resources.disk), so that it never has to
    # grow; 0 (default): sparse, guarded by dsec.resources.diskguard instead.
    sandbox_disk_preallocate: bool = field(
        default_factory=lambda: env_flag("DSEC_SANDBOX_DISK_PREALLOCATE", False)
    )

    # Swap for job pauses (dsec.resources.swap). DSEC_SWAP=auto (default): a
    # platform-managed file below the data dir, created and turned on at start, turned
    # off and deleted at a clean shutdown; off: none. DSEC_SWAP_FILE=/path instead: the
    # operator's file (created if missing, kept). Never under the data dir's sandboxes
    # or a btrfs file system.
    swap: str = field(default_factory=lambda: os.environ.get("DSEC_SWAP", "auto"))
    swap_file: Path | None = field(
        default_factory=lambda: (
            Path(os.environ["DSEC_SWAP_FILE"]) if os.environ.get("DSEC_SWAP_FILE") else None
        )
    )
    swap_gb: int = field(default_factory=lambda: env_int("DSEC_SWAP_GB", 8))
    # Swap through a loop device over the file (large folios swap out whole; SSD mode),
    # unless DSEC_SWAP_LOOP=0: then the file itself (dsec.resources.swap).
    swap_loop: bool = field(default_factory=lambda: env_flag("DSEC_SWAP_LOOP", True))

    # Charge project quotas here (IAM). False on a cluster edge: the apiservers
    # authorise and charge every create before it reaches the edge (dsec.cluster).
    quotas: bool = True
    # Answer creates and stops with this edge's usage (X-DSec-Edge-Load) for the
    # apiservers' placement. Only on a cluster edge: tenants of a single node need not
    # learn how busy the host is.
    report_load: bool = False
    # The URL others reach this process at, when it is not http://host:port (an edge
    # listening on 0.0.0.0 in cluster mode advertises its own address).
    public_url: str | None = None
    # What a shutdown (SIGTERM, Ctrl-C) does with the sandboxes: by default they run on
    # and the next start re-adopts them with their background processes (live restore,
    # as after a crash). DSEC_STOP_SANDBOXES_ON_EXIT=1 (`dsec up --stop-sandboxes-on-exit`)
    # or `dsec down --stop-sandboxes` (STOP_MARKER) stops them all on the way out.
    stop_sandboxes_on_exit: bool = field(
        default_factory=lambda: env_flag("DSEC_STOP_SANDBOXES_ON_EXIT", False)
    )

    @property
    def stop_marker(self) -> Path:
        """``dsec down --stop-sandboxes`` creates it before the SIGTERM."""
        return self.data_dir / "run" / "stop-sandboxes"

    @property
    def managed_swap_file(self) -> Path:
        """The platform-managed swap file (DSEC_SWAP=auto)."""
        return self.data_dir.joinpath(*PLATFORM_SWAP)

    @property
    def url(self) -> str:
        return self.public_url or f"http://{self.host}:{self.port}"

    @property
    def images_dir(self) -> Path:
        return self.data_dir / "images"

    @property
    def sandboxes_dir(self) -> Path:
        return self.data_dir / "sandboxes"

    @property
    def agent_sockets_dir(self) -> Path:
        """Where container sandboxes' agent sockets are bound (see ContainerBackend)."""
        return self.data_dir / "run" / "agents"

    @property
    def control_db(self) -> Path:
        return self.data_dir / "control.db"

    @property
    def edge_db(self) -> Path:
        return self.data_dir / "edge.db"

    @property
    def sandbox_disk_image(self) -> Path:
        """The sandboxes file system's image (never inside a sandbox)."""
        return self.data_dir / "sandboxes.img"

    @property
    def audit_db(self) -> Path:
        """Audit log and events: outside every sandbox, never mounted into one."""
        return self.data_dir / "audit.db"

    @property
    def seccomp_socket(self) -> Path:
        """Where crun hands each sandbox's seccomp notify fd to the edge (0600)."""
        return self.data_dir / "run" / "seccomp.sock"
