"""What every benchmark prints and writes the same way (../shared/BENCHMARKS.md): the run's
context for the JSON file and a markdown table."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import subprocess
import sys


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


@contextlib.contextmanager
def json_line_child(script: str, argv: list[str], env: dict):
    """Runs `python -c script *argv` in the repository root and yields the JSON of the
    first line it prints; the child keeps running (e.g. serving what it offered) until
    its stdin closes on exit, then is waited for (killed after 30 s)."""
    child = subprocess.Popen([sys.executable, "-c", script, *argv], env=env,
                             cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        line = child.stdout.readline()
        if not line:
            raise RuntimeError(f"the child process failed:\n{child.stderr.read()[-3000:]}")
        yield json.loads(line)
    finally:
        child.stdin.close()
        try:
            child.wait(timeout=30)
        except subprocess.TimeoutExpired:
            child.kill()
