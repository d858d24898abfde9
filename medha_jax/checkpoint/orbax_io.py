"""Saving and restoring loaded (sharded) parameters with Orbax.

Converting a GGUF or Hugging Face checkpoint costs a dequantization and a relayout; after
the first load the engine can save its device arrays once and restore them directly into
any sharding later (Orbax reads only each device's part):

    save_params("ckpt/llama", params, config)
    config, params = restore_params("ckpt/llama", shardings)

Layout of the directory:
    params/             the Orbax (StandardCheckpointer) checkpoint of the name -> array dict
    model_config.json   the ModelConfig, and each parameter's shape and dtype
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import jax
import numpy as np

from medha_jax.checkpoint.tensors import CheckpointError
from medha_jax.config import ModelConfig, RopeScaling

# Orbax is imported where it is used: importing it costs ~0.3 s, which every start of a
# server paid although only a save or a restore needs it (issue 26: a warm start <= 5 s).

_PARAMS_DIR = "params"
_CONFIG_FILE = "model_config.json"


def save_params(path: str | pathlib.Path, params: dict[str, jax.Array],
                config: ModelConfig) -> None:
    """Saves `params` (name -> array, any sharding) and `config` to a new directory `path`."""
    path = pathlib.Path(path).absolute()
    if path.exists() and any(path.iterdir()):
        raise FileExistsError(f"{path} exists and is not empty; save into a new directory")
    manifest = {
        "model_config": dataclasses.asdict(config),
        "params": {name: {"shape": list(array.shape), "dtype": np.dtype(array.dtype).name}
                   for name, array in params.items()},
    }
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path / _PARAMS_DIR, dict(params))
        checkpointer.wait_until_finished()
    # Written last, so its presence means the arrays are complete.
    if jax.process_index() == 0:
        (path / _CONFIG_FILE).write_text(json.dumps(manifest, indent=2))


def restore_params(
    path: str | pathlib.Path,
    shardings: dict[str, jax.sharding.Sharding] | None = None,
) -> tuple[ModelConfig, dict[str, jax.Array]]:
    """Restores what `save_params` wrote, each array placed with `shardings[name]`.

    shardings=None puts every array on the first local device (fine for small models;
    pass shardings for anything that must be spread over a mesh).
    """
    path = pathlib.Path(path).absolute()
    config_file = path / _CONFIG_FILE
    if not config_file.is_file():
        raise CheckpointError(f"{path} has no {_CONFIG_FILE}: not a complete save_params directory")
    manifest = json.loads(config_file.read_text())
    config = _config_from_dict(manifest["model_config"])
    specs = manifest["params"]
    if shardings is None:
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        shardings = {name: device for name in specs}
    elif set(shardings) != set(specs):
        missing, extra = sorted(set(specs) - set(shardings)), sorted(set(shardings) - set(specs))
        raise ValueError(f"shardings must name every saved parameter: {missing=} {extra=}")
    target = {
        name: jax.ShapeDtypeStruct(tuple(spec["shape"]), jax.numpy.dtype(spec["dtype"]),
                                   sharding=shardings[name])
        for name, spec in specs.items()
    }
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as checkpointer:
        params = checkpointer.restore(path / _PARAMS_DIR, target)
    return config, dict(params)


def _config_from_dict(fields: dict) -> ModelConfig:
    fields = dict(fields)
    if fields.get("rope_scaling") is not None:
        fields["rope_scaling"] = RopeScaling(**fields["rope_scaling"])
    return ModelConfig(**fields)
