"""Sandboxes started before they are asked for (issue 19: a create near raw crun).

Why: what a create costs beyond ``crun run`` is ~30 steps of Python, HTTP and
bookkeeping of 0.05-0.3 ms each, none worth cutting alone, and ``crun run`` itself is
5.5-6.3 ms of namespaces, cgroups and mounts no bookkeeping can make cheaper. A
sandbox started ahead, while nobody waits, takes all of that off the create that
follows: the create then records, audits and answers, and hands over a container that
was never given to anyone.

What is kept warm: after a create of a *shape* (everything in the spec that the
backend builds from, DSecRunArgs minus the edge's own bookkeeping: labels, job and
trajectory, project, idle TTL), ``per_shape`` sandboxes of that shape, for the last
``max_shapes`` shapes asked for, each until ``idle_seconds`` pass without a create of
its shape. Only what a warm sandbox cannot differ in is pooled: no egress rules (a
network namespace made for it), no protected paths (answers placed for it), a backend
kind that opts in. A warm sandbox is started under the id it will answer to (ids are
random and nothing is reserved by them), so its hostname, cgroup and directory need no
renaming; until a create takes it, it has no record, no idle clock and no quota
charge, and a restarted edge's sweep removes it like anything no record explains.

Never shared, never reused: a warm sandbox is handed to exactly one create and goes
with that sandbox. One that died while warm, or whose image's tags have moved since, is
torn down instead of handed out, and the create starts one as it would have anyway.

When: a refill starts once no create is in flight (``busy``), one sandbox at a time,
so it never competes with the creates it is meant to speed up, and not at all while
the host is short of memory or out of something (``can_refill``). Under memory
pressure admission drains the pool first (``drain``), before any idle sandbox is
squeezed. When the host's layer cache is over its budget and a warm sandbox holds a
layer it would evict, the sandbox goes and its shape is forgotten until asked again
(``let_go``). Closing the edge tears every warm sandbox down.

Only while the edge is in use: once no sandbox has been live on it for
``grace_seconds`` (the last one stopped and no create came), every ready warm sandbox
goes. Warm sandboxes are there for the next create of a workload that is running; an
edge whose sandboxes were all stopped keeps nothing started ahead (no container, quota
group, cgroup or layer hold) a few seconds later, as a leak check or an operator who
stopped everything expects. A loop of create, stop, create keeps its warm sandbox as
long as its pauses are shorter than the grace.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field

from dsec.api.images import ImageInfo
from dsec.api.spec import RunArgs
from dsec.backends.base import BackendFacts
from dsec.linux import pid_alive

log = logging.getLogger(__name__)

# Fields only the edge reads (bookkeeping), never the backend that builds a sandbox.
EDGE_ONLY_FIELDS = frozenset({"labels", "job_id", "trajectory_id", "project", "ttl_running_stop"})
CLOSE_ATTEMPTS = 4
"""Rounds of teardown at close for warm sandboxes whose teardown failed."""
RESERVE_SECONDS = 60.0
"""A warm sandbox reserved for a create (Edge.new_sandbox_id) that never came is
torn down after this long (its caller failed before the create, e.g. a quota)."""


def shape_of(spec: RunArgs) -> str | None:
    """The pool key of ``spec``: its canonical JSON without the edge-only fields; None
    for a spec no warm sandbox may serve (egress rules or protected paths: made for
    one sandbox). A field added to the spec later is part of the shape unless listed
    in EDGE_ONLY_FIELDS: a new field can only make the pool miss, never hand out a
    sandbox built differently."""
    if spec.network_rules or spec.protected:
        return None
    body = spec.model_dump(mode="json", exclude=set(EDGE_ONLY_FIELDS))
    return json.dumps(body, sort_keys=True, separators=(",", ":"))


def same_image(a: ImageInfo, b: ImageInfo) -> bool:
    """Built from the same image: digest and layers (tags resolve to these at create)."""
    return a.digest == b.digest and a.layers == b.layers


def warm_spec(spec: RunArgs) -> RunArgs:
    """The spec a warm sandbox is built from: ``spec`` with the edge-only fields at
    their defaults (no label or job of one caller is ever part of a warm sandbox)."""
    defaults = type(spec).model_fields
    return spec.model_copy(
        update={
            name: defaults[name].get_default(call_default_factory=True) for name in EDGE_ONLY_FIELDS
        }
    )


@dataclass
class Warm:
    """One sandbox started ahead: its id, what its backend keeps of it, the image
    (layers as digests) it was built from."""

    id: str
    shape: str
    facts: BackendFacts
    image: ImageInfo
    spec: RunArgs
    generation: int = 0  # the platform's restarts when it was started (Supervisor)
    reserved_at: float | None = None
    teardown_failures: int = 0

    def alive(self) -> bool:
        """Its init still runs (a cheap look; the edge's death watch follows it from
        the moment a create takes it)."""
        pid = self.facts.init_pid
        return pid is None or pid_alive(pid)


@dataclass
class _Shape:
    spec: RunArgs
    image: ImageInfo
    last_asked: float
    ready: list[Warm] = field(default_factory=list)
    building: int = 0


Build = Callable[[str, RunArgs, ImageInfo], Awaitable[BackendFacts]]
Discard = Callable[[Warm], Awaitable[None]]


class WarmPool:
    """The edge's warm sandboxes, by shape. ``build(id, spec, image)`` starts one (the
    backend's create: on failure it leaves nothing behind), ``discard(warm)`` tears
    one down, ``new_id()`` names one, ``can_refill()`` says the host has room."""

    def __init__(
        self,
        *,
        per_shape: int,
        max_shapes: int,
        idle_seconds: float,
        build: Build,
        discard: Discard,
        new_id: Callable[[], str],
        can_refill: Callable[[], bool],
        generation: Callable[[], int] = lambda: 0,
        live: Callable[[], int] = lambda: 1,
        grace_seconds: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``live()``: how many sandboxes the edge has that are not ended (paused ones
        count); none for ``grace_seconds`` and the ready warm ones go."""
        self.per_shape = per_shape
        self.max_shapes = max_shapes
        self.idle_seconds = idle_seconds
        self.grace_seconds = grace_seconds
        self._live = live
        self._build = build
        self._discard = discard
        self._new_id = new_id
        self._can_refill = can_refill
        self._generation = generation
        self._clock = clock
        self._last_in_use = clock()  # when a sandbox was last seen live (or a create ended)
        self._shapes: OrderedDict[str, _Shape] = OrderedDict()  # least recently asked first
        self._reserved: dict[str, Warm] = {}
        # Teardowns that failed (e.g. the edge out of fds): tried again each tick and
        # at close, so a warm sandbox is never forgotten while it still exists.
        self._unfinished: list[Warm] = []
        self._busy = 0  # creates in flight
        self._quiet = asyncio.Event()
        self._quiet.set()
        self._tasks: set[asyncio.Future[None]] = set()
        self._closed = False
        self.hits = 0
        self.misses = 0

    @property
    def enabled(self) -> bool:
        return self.per_shape > 0 and not self._closed

    def ready_count(self) -> int:
        return sum(1 for _ in self._holders())

    # -- the create path ----------------------------------------------------------------
    def reserve(self, spec: RunArgs) -> str | None:
        """A warm sandbox's id for a create of ``spec`` that is named before it runs
        (the IAM path charges under the final id), or None. The create claims it by
        that id (claim); unclaimed, it is torn down after RESERVE_SECONDS."""
        warm = self._pop(spec)
        if warm is None:
            return None
        self._reserve(warm)
        return warm.id

    def _reserve(self, warm: Warm) -> None:
        """Held under its id for one create; torn down if unclaimed (expire)."""
        warm.reserved_at = self._clock()
        self._reserved[warm.id] = warm

    def unreserve(self, sandbox_id: str) -> None:
        """The create named ``sandbox_id`` will not come (its caller failed first): the
        sandbox goes back to its shape, still never used. Idempotent."""
        warm = self._reserved.pop(sandbox_id, None)
        if warm is not None:
            self.give_back(warm)

    def hold(self, warm: Warm) -> None:
        """``warm``, claimed by a named create that failed before it used it, held under
        its id again until the caller's ``unreserve``: the caller gives back what it did
        under the id first (its quota charge), so no other create is handed this sandbox
        (and charges under the same id) while that is still on record."""
        if self._closed or not warm.alive():
            self._spawn(self._discard_quietly(warm))
            return
        self._reserve(warm)

    def give_back(self, warm: Warm) -> None:
        """A create that took ``warm`` failed before it used it (e.g. admission said
        no): back to its shape, or torn down if that shape is gone or it died."""
        self._reserved.pop(warm.id, None)
        shape = self._shapes.get(warm.shape)
        if shape is None or self._closed or not warm.alive():
            self._spawn(self._discard_quietly(warm))
            return
        warm.reserved_at = None
        shape.ready.append(warm)

    def claim(self, sandbox_id: str) -> Warm | None:
        """The warm sandbox reserved under ``sandbox_id``, if any."""
        return self._reserved.pop(sandbox_id, None)

    def take(self, spec: RunArgs) -> Warm | None:
        """A warm sandbox for ``spec`` (no reservation), or None."""
        return self._pop(spec)

    def _pop(self, spec: RunArgs) -> Warm | None:
        if not self.enabled:
            return None
        key = shape_of(spec)
        shape = self._shapes.get(key) if key is not None else None
        while shape is not None and shape.ready:
            warm = shape.ready.pop()
            if warm.alive():
                return warm
            self._spawn(self._discard_quietly(warm))
        return None

    async def fits(self, warm: Warm, image: ImageInfo) -> Warm | None:
        """``warm`` if it may serve a create whose image resolved to ``image`` now; else
        it is torn down (awaited: its id may be started again at once) and None.

        Not while the host is short of anything (``can_refill`` says no): a backend
        decides some things at create time from the host's state (the disk guard
        refuses a create whose share of the disk would be useless, or clamps its
        limit), and a sandbox started before the shortage skipped that decision. Then
        every warm one goes and the create runs the backend's own checks. Nor one
        started before a platform component restarted (``generation``): the seccomp
        listener that held its notify fd, say, and a fresh sandbox would be watched
        by the new one."""
        if not self._can_refill():
            self.drain()
        elif (
            same_image(warm.image, image) and warm.alive() and warm.generation == self._generation()
        ):
            self.hits += 1
            return warm
        # shielded (and tracked for close): a create cancelled meanwhile must not
        # leave it half torn down
        await asyncio.shield(self._spawn(self._discard_quietly(warm)))
        return None

    @contextlib.contextmanager
    def creating(self) -> Iterator[None]:
        """Around a create's own start: refills wait until none is in flight."""
        self._busy += 1
        self._quiet.clear()
        try:
            yield
        finally:
            self._busy -= 1
            if self._busy == 0:
                self._quiet.set()

    def asked(self, spec: RunArgs, image: ImageInfo, *, hit: bool) -> None:
        """A create of ``spec`` (on ``image``) finished: keep its shape warm."""
        if not self.enabled:
            return
        key = shape_of(spec)
        if key is None:
            return
        if not hit:
            self.misses += 1
        self._last_in_use = self._clock()
        shape = self._shapes.get(key)
        if shape is None or not same_image(shape.image, image):
            old = self._shapes.pop(key, None) if shape is not None else None
            if old is not None:  # the image's tags moved: its warm ones are stale
                for warm in old.ready:
                    self._spawn(self._discard_quietly(warm))
            shape = _Shape(warm_spec(spec), image, self._clock())
            self._shapes[key] = shape
        shape.last_asked = self._clock()
        self._shapes.move_to_end(key)
        while len(self._shapes) > self.max_shapes:
            _, evicted = self._shapes.popitem(last=False)
            for warm in evicted.ready:
                self._spawn(self._discard_quietly(warm))
        if len(shape.ready) + shape.building < self.per_shape:
            shape.building += 1
            self._spawn(self._refill(key, shape))

    async def _refill(self, key: str, shape: _Shape) -> None:
        try:
            await self._quiet.wait()
            if self._closed or self._shapes.get(key) is not shape or not self._can_refill():
                return
            sid = self._new_id()
            generation = self._generation()
            try:
                facts = await self._build(sid, shape.spec, shape.image)
            except Exception as exc:  # nothing left behind (Backend.create's contract)
                log.info("warm sandbox of a shape not started: %s", exc)
                return
            warm = Warm(sid, key, facts, shape.image, shape.spec, generation)
            if self._closed or self._shapes.get(key) is not shape:
                await self._discard_quietly(warm)
                return
            shape.ready.append(warm)
        finally:
            shape.building -= 1

    # -- upkeep -------------------------------------------------------------------------
    def expire(self) -> None:
        """Tear down what nobody asked for lately, reservations never claimed, and
        every ready one once the edge has had no live sandbox for ``grace_seconds``;
        try the teardowns that failed again."""
        self._finish_teardowns()
        now = self._clock()
        if self._live() > 0:
            self._last_in_use = now
        elif now - self._last_in_use >= self.grace_seconds:
            self.drain()  # shapes stay known: the next create warms its shape again
        for key, shape in list(self._shapes.items()):
            if now - shape.last_asked >= self.idle_seconds:
                del self._shapes[key]
                for warm in shape.ready:
                    self._spawn(self._discard_quietly(warm))
        for sid, warm in list(self._reserved.items()):
            if warm.reserved_at is not None and now - warm.reserved_at >= RESERVE_SECONDS:
                del self._reserved[sid]
                self._spawn(self._discard_quietly(warm))

    async def loop(self, every: float = 1.0) -> None:
        while True:
            await asyncio.sleep(every)
            self.expire()
            if self.ready_count() and not self._can_refill():
                self.drain()  # the host is short: what was started ahead gives way

    def drain(self) -> int:
        """Tear every ready warm sandbox down (the host needs the room); returns how
        many. Shapes stay known: the pool fills again once there is room."""
        n = 0
        for shape in self._shapes.values():
            for warm in shape.ready:
                self._spawn(self._discard_quietly(warm))
                n += 1
            shape.ready.clear()
        return n

    def let_go(self, layers: Mapping[str, int]) -> int:
        """The host's layer cache is over its budget and cannot evict ``layers``
        (``sha256:<hex>`` -> users now) because they are in use. Where warm sandboxes
        are a layer's only users, every shape built on it is forgotten and its ready
        sandboxes torn down: their teardown releases the layer and the cache evicts it
        then. A layer a running sandbox uses stays whatever the pool does, so its warm
        sandboxes stay too. Such a shape is warm again only after its next create:
        kept warm at once, it would take the layer straight back. Reserved ones stay
        (a create is about to take them). Returns how many were torn down."""
        holds: Counter[str] = Counter()
        for warm in self._holders():
            holds.update(warm.image.layers)  # one user per acquire, as the backend does
        only_warm = {d for d, users in layers.items() if 0 < users <= holds[d]}
        n = 0
        for key, shape in list(self._shapes.items()):
            if only_warm.isdisjoint(shape.image.layers):
                continue
            del self._shapes[key]
            for warm in shape.ready:
                self._spawn(self._discard_quietly(warm))
                n += 1
        if n:
            log.info("%d warm sandboxes let go of layers the layer cache wants back", n)
        return n

    def _holders(self) -> Iterator[Warm]:
        """Every warm sandbox started and not yet taken: ready, reserved, or one whose
        teardown has yet to succeed."""
        for shape in self._shapes.values():
            yield from shape.ready
        yield from self._reserved.values()
        yield from self._unfinished

    def _finish_teardowns(self) -> None:
        """Try the failed teardowns again."""
        failed, self._unfinished = self._unfinished, []
        for warm in failed:
            self._spawn(self._discard_quietly(warm))

    async def close(self) -> None:
        """Tear down every warm sandbox, reserved ones included; no refill after."""
        self._closed = True
        self._quiet.set()  # refills waiting for quiet wake up and see the pool closed
        self.drain()
        for warm in list(self._reserved.values()):
            self._spawn(self._discard_quietly(warm))
        self._reserved.clear()
        for attempt in range(CLOSE_ATTEMPTS):
            while self._tasks:
                await asyncio.gather(*list(self._tasks), return_exceptions=True)
            if not self._unfinished or attempt == CLOSE_ATTEMPTS - 1:
                break
            await asyncio.sleep(0.2 * (attempt + 1))  # e.g. the fds come back
            self._finish_teardowns()

    def _spawn(self, coro: Awaitable[None]) -> asyncio.Future[None]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _discard_quietly(self, warm: Warm) -> None:
        try:
            await self._discard(warm)
        except Exception as exc:
            # Kept and tried again (each tick, and at close); what still fails at close
            # the sweep of the next start removes, like anything no record explains.
            warm.teardown_failures += 1
            if warm.teardown_failures in (1, 10, 100):  # said now and then, not every tick
                log.warning("warm sandbox %s not torn down (will retry): %s", warm.id, exc)
            self._unfinished.append(warm)
