"""The HTTP API of the platform (FastAPI); see ``create_app``."""

from dsec.apiserver.app import create_app
from dsec.apiserver.limits import ApiLimits

__all__ = ["ApiLimits", "create_app"]
