"""dsec.config's one parser of DSEC_* settings (env_int, env_float, env_flag).

Unset or empty gives the default; a value out of bounds or of the wrong kind is a typed
InvalidArgument naming the variable, what it takes and what it got.
"""

from __future__ import annotations

import pytest

from dsec.config import PlatformConfig, env_flag, env_float, env_int, env_optional_int
from dsec.errors import InvalidArgument

VAR = "DSEC_TEST_SETTING"


def test_unset_and_empty_give_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(VAR, raising=False)
    assert env_int(VAR, 7) == 7 and env_float(VAR, 2.5) == 2.5 and env_flag(VAR, True)
    assert env_optional_int(VAR) is None
    monkeypatch.setenv(VAR, " ")
    assert env_int(VAR, 7) == 7 and not env_flag(VAR, False)


@pytest.mark.parametrize(
    ("raw", "value"), [("1", True), ("yes", True), ("ON", True), ("0", False), ("false", False)]
)
def test_flags(monkeypatch: pytest.MonkeyPatch, raw: str, value: bool) -> None:
    monkeypatch.setenv(VAR, raw)
    assert env_flag(VAR, not value) is value


@pytest.mark.parametrize(
    ("parse", "raw", "says"),
    [
        (lambda: env_int(VAR, 1), "8G", "must be a whole number, got '8G'"),
        (lambda: env_int(VAR, 1), "-3", "must be a whole number >= 0, got '-3'"),
        (lambda: env_int(VAR, 1, minimum=1, maximum=9), "10", ">= 1 and <= 9, got '10'"),
        (lambda: env_float(VAR, 1.0), "fast", "must be a number, got 'fast'"),
        (lambda: env_float(VAR, 1.0), "nan", "must be a finite number"),
        (lambda: env_float(VAR, 1.0, maximum=100), "150", "<= 100, got '150'"),
        (lambda: env_flag(VAR, True), "maybe", "must be 1 or 0"),
    ],
)
def test_bad_values_are_typed_and_say_what_is_wanted(
    monkeypatch: pytest.MonkeyPatch, parse: object, raw: str, says: str
) -> None:
    monkeypatch.setenv(VAR, raw)
    assert callable(parse)
    with pytest.raises(InvalidArgument) as info:
        parse()
    assert str(info.value).startswith(VAR) and says in str(info.value)


def test_platform_config_reads_through_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSEC_SWAP_GB", "3")
    monkeypatch.setenv("DSEC_SANDBOX_DISK_PREALLOCATE", "true")
    monkeypatch.setenv("DSEC_ADMISSION_PRESSURE", "0")
    monkeypatch.delenv("DSEC_MAX_SANDBOXES", raising=False)
    cfg = PlatformConfig()
    assert cfg.swap_gb == 3 and cfg.sandbox_disk_preallocate and cfg.admission_pressure == 0
    assert cfg.max_sandboxes is None
    monkeypatch.setenv("DSEC_TOKEN_TTL", "0")
    with pytest.raises(InvalidArgument, match="DSEC_TOKEN_TTL must be a number >= 1"):
        PlatformConfig()
