"""Which megatron-core releases this adapter supports, checked when an engine starts.

The adapter reaches into megatron-core's public modules (parallel_state,
GPTModel and its layer specs, the pipeline schedules, DistributedDataParallel,
the optimizer and dist_checkpointing); their signatures move between minor
releases, so a version outside the declared range is refused up front with
the fix, rather than failing later inside a rank with a TypeError.
"""

from __future__ import annotations

import sys
from importlib import metadata

from packaging.version import InvalidVersion, Version

from asyncflow_core.errors import EngineError

#: Oldest supported release (the API this adapter is written against).
MIN_VERSION = Version("0.16.0")
#: Releases from this one on are refused (not yet checked against the API).
MAX_EXCLUSIVE = Version("0.20.0")
#: megatron-core 0.17 and newer require Python 3.12: on 3.11 the newest is 0.16.1.
MAX_ON_PY311 = Version("0.16.1")
#: What has actually run: the CPU tests in adapters/megatron/tests (see docs/adapters/megatron.md).
TESTED = ("0.16.1",)


def supported_range() -> str:
    """The supported range on this interpreter, as a pip requirement."""
    if sys.version_info < (3, 12):
        return f"megatron-core>={MIN_VERSION},<={MAX_ON_PY311}"
    return f"megatron-core>={MIN_VERSION},<{MAX_EXCLUSIVE}"


def check_version(installed: str | None) -> Version:
    """Return the installed megatron-core version, or raise :class:`EngineError` saying what to install."""
    want = supported_range()
    if installed is None:
        raise EngineError(f"the megatron train engine needs megatron-core, which is not installed: "
                          f"pip install '{want}'")
    try:
        version = Version(installed)
    except InvalidVersion:
        raise EngineError(f"megatron-core reports an unreadable version {installed!r}; install a release: "
                          f"pip install '{want}'") from None
    release = Version(version.base_version)
    if release < MIN_VERSION or release >= MAX_EXCLUSIVE:
        raise EngineError(f"megatron-core {installed} is not supported by asyncflow-megatron (supported: {want}); "
                          f"pip install '{want}'")
    return version


def installed_version() -> str | None:
    """The installed megatron-core version from package metadata (no import of megatron)."""
    try:
        return metadata.version("megatron-core")
    except metadata.PackageNotFoundError:
        return None


def require_megatron() -> Version:
    """Check the installed megatron-core against the supported range (called before the ranks start)."""
    return check_version(installed_version())
