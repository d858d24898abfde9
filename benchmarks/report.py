"""What every benchmark prints and writes the same way (../shared/BENCHMARKS.md): the run's
context for the JSON file and a markdown table."""

from __future__ import annotations

import datetime
import platform


def environment() -> dict:
    """Back-end, device kind and count, versions and the date, for the JSON context."""
    import jax
    import jaxlib

    devices = jax.devices()
    return {"backend": jax.default_backend(), "device_kind": devices[0].device_kind,
            "device_count": len(devices), "jax": jax.__version__,
            "jaxlib": jaxlib.__version__, "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def table(title: str, rows: list[dict]) -> None:
    """Prints rows (dicts with the same keys, units in the names) as a markdown table."""
    print(f"\n{title}")
    columns = list(rows[0])
    print(" | ".join(columns))
    print(" | ".join("---" for _ in columns))
    for row in rows:
        print(" | ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in row.values()))
