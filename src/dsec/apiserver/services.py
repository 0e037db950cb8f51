"""What one apiserver app serves: the services a composition root hands to ``create_app``.

A root (dsec.roots: `dsec up`, `dsec apiserver`, `dsec edge --join`) builds every
service once and puts it here; ``create_app`` only turns what it is given into routes
and constructs nothing that holds state of its own beyond HTTP plumbing. One frozen value
instead of a dozen optional keyword arguments means a root says in one place what its
API offers, and a route family is served exactly when its service is present.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dsec.apiserver.creator import SandboxCreator
from dsec.apiserver.filestreams import FileStreams
from dsec.apiserver.fncall import FnCallBackend
from dsec.apiserver.limits import ApiLimits
from dsec.apiserver.relay import EdgeRelay
from dsec.apiserver.rl import RLEdge
from dsec.apiserver.rollouts import Rollouts
from dsec.apiserver.security import AuditQuery
from dsec.apiserver.trajectory import TrajectoryRemote
from dsec.control.iam import IAM
from dsec.control.keys import KeyStore
from dsec.control.roles import RoleStore
from dsec.edge.admission import Admission
from dsec.edge.api import EdgeAPI
from dsec.edge.dataplane import DataPlane
from dsec.fncall.service import FnCallService
from dsec.images.layers import LayerService
from dsec.images.service import ImageService
from dsec.observe.metrics import Metrics
from dsec.rl.trajectory import TrajectoryService
from dsec.rollouts.manager import RolloutManager
from dsec.security.audit import AuditLog


@dataclass(frozen=True)
class BatchLimits:
    """Creates in flight for the app's batch runner (dsec.control.batch.BatchRunner).

    None keeps the runner's own defaults (a few per core, or the environment). A
    cluster apiserver raises them: there a create is a request to some edge, not CPU
    of this host."""

    parallelism: int | None = None
    max_in_flight: int | None = None


@dataclass(frozen=True)
class ApiServices:
    """Every service an apiserver app uses; None means that route family is not served.

    ``edge`` is the in-process Edge (`dsec up`, a cluster edge) or the ClusterEdge of a
    cluster apiserver. ``rl`` is the edge that pauses jobs and packs or forks sandboxes;
    its routes need ``roles`` too. ``creator`` is the one create path of sandboxes and
    batches (a default one over ``edge`` and ``iam`` when not given)."""

    edge: EdgeAPI
    keys: KeyStore
    images: ImageService | None = None  # None in a cluster apiserver: images live on edges
    limits: ApiLimits = field(default_factory=ApiLimits)
    dataplane: DataPlane | None = None
    layers: LayerService | None = None
    audit: AuditLog | AuditQuery | None = None
    fncall: FnCallService | FnCallBackend | None = None
    trajectory: TrajectoryService | TrajectoryRemote | None = None
    roles: RoleStore | None = None
    rl: RLEdge | None = None
    # Who streams file bodies of the control routes (default: the data plane; the
    # cluster router forwards them to the sandbox's edge).
    streams: FileStreams | None = None
    creator: SandboxCreator | None = None
    # Who passes per-sandbox requests on to the sandbox's own edge (a cluster
    # apiserver's router): the E2B drop-in relays envd through it.
    relay: EdgeRelay | None = None
    iam: IAM | None = None  # charges quotas; also serves projects, principals, keys
    # A cluster edge states its usage in create/stop answers (dsec.control.placement):
    # whose usage. None on a single node and on apiservers.
    report_load: Admission | None = None
    batches: BatchLimits = field(default_factory=BatchLimits)
    # Prometheus metrics served at /metrics (dsec.observe.metrics); None: not served.
    metrics: Metrics | None = None
    # Hosted rollouts and their model gateway (dsec.rollouts); None: not served.
    rollouts: RolloutManager | Rollouts | None = None
