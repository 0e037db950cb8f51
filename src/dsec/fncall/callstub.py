"""``client.call(fn, *args)``: what runs inside the sandbox.

The caller pickles ``(fn, args, kwargs)`` with cloudpickle (functions by value, the
library Ray, Dask and PySpark use for exactly this). The image needs no package:
cloudpickle is pure Python and travels with the call (its source files, from the
platform's own installation). The stub refuses a different Python minor version,
whose bytecode and pickles need not match, before unpickling anything.
"""

from __future__ import annotations

import base64
from functools import cache
from pathlib import Path

RESULT = "_dsec/result.bin"
VERSION_MISMATCH = b"VERSION_MISMATCH "

_STUB = """\
import sys
_want = {python!r}
if "%d.%d" % sys.version_info[:2] != _want:
    with open("/tmp/work/{result}", "wb") as f:
        f.write(b"VERSION_MISMATCH %d.%d" % sys.version_info[:2])
    sys.exit(3)
sys.path.insert(0, "/tmp/work/_dsec")
import base64, traceback
import cloudpickle
with open("/tmp/work/_dsec/call.b64", "rb") as f:
    fn, args, kwargs = cloudpickle.loads(base64.b64decode(f.read()))
try:
    out = (True, fn(*args, **kwargs), "")
except BaseException as exc:
    out = (False, exc, traceback.format_exc())
try:
    data = cloudpickle.dumps(out)
except Exception as exc:
    data = cloudpickle.dumps((False, RuntimeError("result not picklable: %r" % exc), ""))
with open("/tmp/work/{result}", "wb") as f:
    f.write(data)
sys.exit(0 if out[0] else 1)
"""


def stub(python: str) -> str:
    return _STUB.format(python=python, result=RESULT)


@cache
def _cloudpickle_sources() -> dict[str, str]:
    import cloudpickle

    pkg = Path(cloudpickle.__file__).parent
    return {f"_dsec/cloudpickle/{p.name}": p.read_text() for p in sorted(pkg.glob("*.py"))}


def files(payload: bytes) -> dict[str, str]:
    return {**_cloudpickle_sources(), "_dsec/call.b64": base64.b64encode(payload).decode()}
