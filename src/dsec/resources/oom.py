"""Who the kernel's OOM killer takes first when the host itself runs out of memory.

A sandbox's memory cgroup keeps it within its own limit, but admission counts use, not
the sum of limits (dsec.edge.admission), so sandboxes that all grow at once can run the
host out of memory. The kernel then kills the process with the highest badness: its
resident memory plus ``oom_score_adj`` thousandths of the host's memory. Left at the
default (0) everywhere, that can be the platform: at 10,000 sandboxes the edge holds
hundreds of MiB, more than any one small sandbox process, and with it would go every
sandbox's bookkeeping, the lazy layer daemon every lazily loaded sandbox reads through,
and the seccomp listener.

So every process a sandbox runs carries a positive bias, set by the platform when the
sandbox starts and inherited by all it forks (``OOM_SCORE_ADJ``): a best-effort
sandbox's and a function call's 1000 (taken first: batch work and stateless calls cost
least to lose), a latency sandbox's 500 (half the host's memory added to its badness:
it goes before any platform process unless that one holds more than half the host).
The platform's own processes keep the kernel's default, so that nothing they start
inherits a bias by accident.

Why it holds against root in a sandbox: the kernel lets a process lower its
``oom_score_adj`` only to the lowest value a writer with CAP_SYS_RESOURCE set for it
(``oom_score_adj_min``), and sandboxes have no CAP_SYS_RESOURCE. crun's
``process.oomScoreAdj`` puts the value in place before the sandbox's first
instruction; whether crun's write also sets the floor depends on the capabilities
crun holds at that moment, so the platform writes it again from the host right after
the start (``set_oom_score_adj``: the sandbox's processes, a QEMU; the FnCall zygote
writes each of its sandboxes' before the sandbox runs, so its steps inherit value and
floor), which makes the floor the bias itself. Raising it further is allowed and only
hurts the sandbox that does.

Where the platform itself runs without CAP_SYS_RESOURCE (some container hosts drop it
from root's bounding set, as our CI machines do) no floor can be set: root inside may
lower the bias back to 0 (never below), the platform's own value; the health report
says which (``floor_enforced``).
"""

from __future__ import annotations

import contextlib
from functools import cache

#: ``oom_score_adj`` of every process of a sandbox, per QoS class (dsec.resources.qos).
OOM_SCORE_ADJ: dict[str, int] = {"latency": 500, "best_effort": 1000}

#: ``oom_score_adj`` of a function call's sandbox (dsec.fncall): stateless and short.
FNCALL_OOM_SCORE_ADJ = 1000


def oom_score_adj(qos: str) -> int:
    """The OOM bias of a sandbox of class ``qos``."""
    return OOM_SCORE_ADJ[qos]


def set_oom_score_adj(pid: int, value: int) -> None:
    """Set process ``pid``'s ``oom_score_adj`` (and, written with CAP_SYS_RESOURCE,
    the floor it cannot go below). A process already gone is no error."""
    with (
        contextlib.suppress(ProcessLookupError, FileNotFoundError),
        open(f"/proc/{pid}/oom_score_adj", "w", encoding="ascii") as fh,
    ):
        fh.write(str(value))


def oom_score_adj_of(pid: int) -> int:
    """Process ``pid``'s ``oom_score_adj`` (for tests and stats)."""
    with open(f"/proc/{pid}/oom_score_adj", encoding="ascii") as fh:
        return int(fh.read())


CAP_SYS_RESOURCE = 24


@cache
def floor_enforced() -> bool:
    """Whether this process writes ``oom_score_adj`` with CAP_SYS_RESOURCE in effect
    (so that what it writes is also the floor a sandbox cannot go below)."""
    with open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> CAP_SYS_RESOURCE & 1)
    return False


def health_detail() -> dict[str, str]:
    """What /v1/health's backend details say about the OOM bias on this host."""
    values = ", ".join(f"{cls} {adj}" for cls, adj in OOM_SCORE_ADJ.items())
    floor = (
        "root inside cannot lower it"
        if floor_enforced()
        else "advisory: the platform lacks CAP_SYS_RESOURCE, root inside may lower it to 0"
    )
    return {"oom_score_adj": f"{values}; {floor}"}
