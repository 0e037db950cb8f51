"""The HTTP API of the platform (FastAPI); see ``create_app`` and ``ApiServices``."""

from dsec.apiserver.app import create_app
from dsec.apiserver.limits import ApiLimits
from dsec.apiserver.services import ApiServices, BatchLimits

__all__ = ["ApiLimits", "ApiServices", "BatchLimits", "create_app"]
