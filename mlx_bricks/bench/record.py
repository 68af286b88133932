"""What every benchmark document records besides its figures: when (UTC), the load of a shared
CPU, and the versions that ran (``bench.core`` and ``bench.user_path`` both write them)."""
from __future__ import annotations

import datetime
import os


def now() -> str:
    """The time in UTC, ISO 8601 to the second."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages (a shared CPU slows one run and not the next), where
    the OS has them."""
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def version(dist: str) -> str | None:
    """The installed version of distribution ``dist``, or None."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed(dist)
    except PackageNotFoundError:
        return None
