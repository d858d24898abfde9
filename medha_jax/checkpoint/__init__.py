"""Checkpoints: files -> a ModelConfig, lazy canonical tensors, and a tokenizer.

    from medha_jax.checkpoint import load_gguf_checkpoint, default_model_path
    ckpt = load_gguf_checkpoint(default_model_path())
    wq = ckpt.tensors["layers.wq"]          # TensorSource, shape [L, D, H, hd]
    jax.make_array_from_callback(wq.shape, sharding, wq.read)

Canonical names and layouts are documented in `tensors.py`.
"""

from medha_jax.checkpoint.gguf_file import default_model_path, load_gguf_checkpoint
from medha_jax.checkpoint.hf import load_hf_checkpoint
from medha_jax.checkpoint.orbax_io import restore_params, save_params
from medha_jax.checkpoint.tensors import Checkpoint, CheckpointError, TensorSource
from medha_jax.checkpoint.tokenizer import Tokenizer

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "TensorSource",
    "Tokenizer",
    "default_model_path",
    "load_gguf_checkpoint",
    "load_hf_checkpoint",
    "restore_params",
    "save_params",
]
