"""gRPC definitions; their generated Python stubs are built, never committed.

setup.py's build step compiles the .proto files here into `<name>_pb2.py` and
`<name>_pb2_grpc.py` beside them. So that a fresh checkout or editable install always
works, importing this package does the same when a stub is missing or older than its
.proto (grpcio-tools is therefore a core install requirement).

The stubs are compiled with the repository root as the include path, so they import each
other as `serving.proto.medha_pb2`, matching the package layout.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import tempfile

PROTO_DIR = pathlib.Path(__file__).resolve().parent
PROTO_NAMES = ("medha",)


def _stale(name: str) -> bool:
    source = PROTO_DIR / f"{name}.proto"
    outputs = [PROTO_DIR / f"{name}_pb2.py", PROTO_DIR / f"{name}_pb2_grpc.py"]
    if not all(out.exists() for out in outputs):
        return True
    # An installed package (read-only site-packages) keeps the stubs it was built with,
    # whatever the file times its installer left.
    return os.access(PROTO_DIR, os.W_OK) and any(
        out.stat().st_mtime < source.stat().st_mtime for out in outputs)


def generate_stubs(force: bool = False) -> list[str]:
    """Compiles every stale .proto here; returns the names compiled."""
    stale = [name for name in PROTO_NAMES if force or _stale(name)]
    if not stale:
        return []
    try:
        import grpc_tools
        from grpc_tools import protoc
    except ImportError as e:
        raise ImportError(
            f"the gRPC stubs for {stale} are missing in {PROTO_DIR} and grpcio-tools, which "
            "builds them, is not installed: pip install grpcio-tools") from e
    root = PROTO_DIR.parent.parent            # the include root: serving/proto/x.proto
    well_known = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    # Compile into a scratch directory and move the files in with an atomic rename, so
    # concurrent importers never read a half-written stub.
    with tempfile.TemporaryDirectory(dir=PROTO_DIR, prefix=".protoc-") as scratch:
        for name in stale:
            source = (PROTO_DIR / f"{name}.proto").relative_to(root)
            rc = protoc.main(["grpc_tools.protoc", f"-I{root}", f"-I{well_known}",
                              f"--python_out={scratch}", f"--grpc_python_out={scratch}",
                              str(source)])
            if rc != 0:
                raise RuntimeError(f"protoc failed with exit status {rc} on {source}")
        built = pathlib.Path(scratch) / PROTO_DIR.relative_to(root)
        for out in built.glob("*_pb2*.py"):
            os.replace(out, PROTO_DIR / out.name)
    return stale


def clean_stubs() -> None:
    """Deletes the generated stubs (they are rebuilt on the next import)."""
    for path in PROTO_DIR.glob("*_pb2*.py"):
        path.unlink()
    shutil.rmtree(PROTO_DIR / "__pycache__", ignore_errors=True)


generate_stubs()
