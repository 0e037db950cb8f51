"""The two base classes of every wire model: the one place that decides compatibility.

Requests (``Strict``) refuse unknown fields: a typo such as ``memory_limit=`` must
fail loudly, not be ignored. Replies (``Reply``) ignore unknown fields, so an older
SDK keeps working when a newer server adds one. Every model that crosses a process
boundary derives from one of them; a subclass may add ``frozen`` (value objects such as
``LayerRef``), never its own ``extra``.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    """Requests: an unknown field is a caller's typo and must fail loudly."""

    model_config = ConfigDict(extra="forbid", frozen=False)


class Reply(BaseModel):
    """Responses: an older SDK must keep working when a newer server adds fields."""

    model_config = ConfigDict(extra="ignore", frozen=False)
