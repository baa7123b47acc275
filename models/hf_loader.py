"""Load Hugging Face Llama checkpoints (``config.json`` + ``*.safetensors``) into :class:`Llama`.

Only local files are read; nothing is downloaded. HF stores linear weights as
``(out, in)``; Flax kernels are ``(in, out)``, so they are transposed. HF's
q/k projections are already laid out for the ``rotate_half`` rotary convention
that ``models.llama`` uses, so no permutation is needed.

Example:
    >>> model = load_hf_llama("/path/to/Llama-2-7b-hf")  # doctest: +SKIP
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx
from safetensors import safe_open

from models.llama import Llama, LlamaConfig, as_dtype

_LAYER_WEIGHTS = {
    "input_layernorm": ("attn_norm", "scale", False),
    "self_attn.q_proj": ("attn", "q_proj", True),
    "self_attn.k_proj": ("attn", "k_proj", True),
    "self_attn.v_proj": ("attn", "v_proj", True),
    "self_attn.o_proj": ("attn", "o_proj", True),
    "post_attention_layernorm": ("mlp_norm", "scale", False),
    "mlp.gate_proj": ("mlp", "gate_proj", True),
    "mlp.up_proj": ("mlp", "up_proj", True),
    "mlp.down_proj": ("mlp", "down_proj", True),
}


def config_from_hf(hf: Mapping[str, Any], **overrides: Any) -> LlamaConfig:
    """Translate an HF Llama ``config.json`` dict into a :class:`LlamaConfig`.

    Args:
        hf: the parsed ``config.json``.
        **overrides: fields to set on the result (e.g. ``dtype="bf16"``).

    Raises:
        ValueError: for a model type or feature this loader does not implement.

    Example:
        >>> config_from_hf({"hidden_size": 64, "intermediate_size": 172,
        ...     "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 100}).n_kv_heads
        4
    """
    model_type = hf.get("model_type", "llama")
    if model_type != "llama":
        raise ValueError(f"config.json has model_type={model_type!r}; only 'llama' is supported")
    if hf.get("rope_scaling"):
        raise ValueError(f"rope_scaling={hf['rope_scaling']!r} is not supported")
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise ValueError("Llama variants with attention or MLP biases are not supported")
    n_heads = hf["num_attention_heads"]
    fields: dict[str, Any] = dict(
        vocab_size=hf["vocab_size"],
        d_model=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        d_ff=hf["intermediate_size"],
        head_dim=hf.get("head_dim"),
        rope_theta=float(hf.get("rope_theta", 10000.0)),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_seq_len=int(hf.get("max_position_embeddings", 2048)),
    )
    if fields["head_dim"] == fields["d_model"] // n_heads:
        fields["head_dim"] = None
    fields.update(overrides)
    return LlamaConfig(**fields)


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / name for name in sorted(set(weight_map.values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    return files


def iter_tensors(path: str | Path) -> Iterator[tuple[str, np.ndarray]]:
    """Yield ``(name, array)`` for every tensor of the checkpoint in directory ``path``.

    Example:
        >>> dict(iter_tensors("/path/to/ckpt"))  # doctest: +SKIP
    """
    for file in _safetensors_files(Path(path)):
        with safe_open(str(file), framework="numpy") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def hf_to_pure_dict(tensors: Mapping[str, np.ndarray], config: LlamaConfig) -> dict[str, Any]:
    """Map HF tensor names to the nested dict of :class:`Llama` parameters.

    Args:
        tensors: HF names (``model.layers.0.self_attn.q_proj.weight``, ...) to arrays.
        config: the model's configuration.

    Returns:
        A pure dict shaped like ``nnx.state(model, nnx.Param).to_pure_dict()``.

    Raises:
        KeyError: a weight the model needs is missing.

    Example:
        >>> hf_to_pure_dict({}, LlamaConfig())  # doctest: +IGNORE_EXCEPTION_DETAIL
        Traceback (most recent call last):
        KeyError: 'model.embed_tokens.weight'
    """

    def get(name: str) -> np.ndarray:
        if name not in tensors:
            raise KeyError(name)
        return np.asarray(tensors[name])

    layers: dict[int, Any] = {}
    for i in range(config.n_layers):
        layer: dict[str, Any] = {}
        for hf_name, (module, leaf, is_linear) in _LAYER_WEIGHTS.items():
            weight = get(f"model.layers.{i}.{hf_name}.weight")
            if is_linear:
                layer.setdefault(module, {})[leaf] = {"kernel": weight.T}
            else:
                layer[module] = {leaf: weight}
        layers[i] = layer
    pure: dict[str, Any] = {
        "embed": {"embedding": get("model.embed_tokens.weight")},
        "layers": layers,
        "norm": {"scale": get("model.norm.weight")},
    }
    if not config.tie_embeddings:
        pure["lm_head"] = {"kernel": get("lm_head.weight").T}
    return pure


def llama_from_tensors(
    tensors: Mapping[str, np.ndarray], config: LlamaConfig
) -> Llama:
    """Build a :class:`Llama` whose parameters are HF-named ``tensors`` (no random init).

    Args:
        tensors: HF names to arrays, e.g. from :func:`iter_tensors`.
        config: the model's configuration; parameters take its ``param_dtype``.

    Raises:
        KeyError: a weight is missing.
        ValueError: a weight's shape does not match ``config``.

    Example:
        >>> model = llama_from_tensors(dict(iter_tensors("ckpt")), config)  # doctest: +SKIP
    """
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0))))
    pure = hf_to_pure_dict(tensors, config)
    target = as_dtype(config.param_dtype)

    def convert(key_path: tuple[Any, ...], spec: jax.ShapeDtypeStruct, value: np.ndarray) -> Any:
        if tuple(value.shape) != tuple(spec.shape):
            raise ValueError(f"{jax.tree_util.keystr(key_path)}: checkpoint shape {value.shape} "
                             f"!= model shape {spec.shape}")
        return jax.numpy.asarray(value, dtype=target)

    state.replace_by_pure_dict(jax.tree_util.tree_map_with_path(convert, state.to_pure_dict(),
                                                                pure))
    return nnx.merge(graphdef, state)


def load_hf_llama(
    path: str | Path, *, param_dtype: str | None = None, dtype: str | None = None
) -> Llama:
    """Build a :class:`Llama` from an HF checkpoint directory without random init.

    Args:
        path: directory with ``config.json`` and ``*.safetensors`` (sharded or not).
        param_dtype: parameter dtype; default float32.
        dtype: compute dtype; default float32.

    Returns:
        The model, with every parameter taken from the checkpoint.

    Raises:
        KeyError: the checkpoint lacks a weight.
        ValueError: a weight's shape does not match ``config.json``.

    Example:
        >>> model = load_hf_llama("ckpt_dir", dtype="bf16")  # doctest: +SKIP
    """
    path = Path(path)
    hf_config = json.loads((path / "config.json").read_text())
    config = config_from_hf(
        hf_config, param_dtype=param_dtype or "float32", dtype=dtype or "float32"
    )
    return llama_from_tensors(dict(iter_tensors(path)), config)
