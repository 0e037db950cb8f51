"""SandboxFusion drop-in: ``POST /run_code`` on the FnCall backend, for the unmodified
``sandbox-fusion`` client and verl's reward and tool code.

Point them at the platform with the API key in the URL's userinfo, which ``requests``
sends as HTTP Basic auth (never in the path, so never in an access log)::

    SANDBOX_FUSION_ENDPOINT=http://dsec:<api key>@127.0.0.1:8470

See README "SandboxFusion" for the mapping and what is not supported.
"""

from dsec.compat.sandboxfusion.routes import sandboxfusion_router

__all__ = ["sandboxfusion_router"]
