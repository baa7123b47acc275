"""Plain Flax NNX models. Nothing here imports jaxmem: user code needs no changes."""

from models.llama import CHECKPOINT_NAMES, CONFIGS, Llama, LlamaConfig, get_config, init_llama

__all__ = ["CHECKPOINT_NAMES", "CONFIGS", "Llama", "LlamaConfig", "get_config", "init_llama"]
