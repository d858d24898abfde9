"""medha-jax: serving long-context LLMs with LARS scheduling and adaptive chunking.

    from medha_jax import load_model, ParallelConfig
    model = load_model("smollm2-135m", parallel=ParallelConfig(tp=1))
    logits = model.logits(model.tokenizer.encode("hello"))

    from medha_jax import Server, SamplingParams
    with Server("smollm2-135m") as server:
        print(server.generate("Hello", SamplingParams(temperature=0, max_tokens=16)).text)

Heavy modules (JAX, the server) are imported on first use, so `import medha_jax` is cheap.
"""

from medha_jax.config import MODEL_PRESETS, ModelConfig, ParallelConfig, RopeScaling
from medha_jax.request import SLO
from medha_jax.sampling_params import SamplingParams

_LAZY = {
    "load_model": ("medha_jax.model", "load_model"),
    "Model": ("medha_jax.model", "Model"),
    "Server": ("serving.server", "Server"),
    "Engine": ("medha_jax.engine", "Engine"),
    "EngineConfig": ("medha_jax.engine", "EngineConfig"),
    "SchedulerConfig": ("medha_jax.scheduler.config", "SchedulerConfig"),
    "TokensPrompt": ("serving.validation", "TokensPrompt"),
}

__all__ = ["MODEL_PRESETS", "ModelConfig", "ParallelConfig", "RopeScaling", "SLO",
           "SamplingParams", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        import importlib
        module_name, attr = _LAZY[name]
        value = getattr(importlib.import_module(module_name), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'medha_jax' has no attribute {name!r}")
