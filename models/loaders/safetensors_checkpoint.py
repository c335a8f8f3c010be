"""Load a Hugging Face Llama / Qwen3 checkpoint directory (config.json + safetensors) into `DecoderParams`.

Accepts a single `model.safetensors` or shards listed by `model.safetensors.index.json`. Weights are
cast to BF16 and linear weights transposed to [in, out].
"""

from __future__ import annotations

import contextlib
import json
import os

import jax.numpy as jnp
import numpy as np
from safetensors import SafetensorError, safe_open

from models.configs import ModelConfig, RopeScaling
from models.loaders.jsonfile import read_json
from models.params import DecoderParams, LayerParams, expected_shapes

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_MODEL_TYPES = ("llama", "qwen3")

# LayerParams field -> (tensor name under model.layers.{i}., transpose to [in, out]).
_LAYER_TENSORS = {
    "attn_norm": ("input_layernorm", False),
    "wq": ("self_attn.q_proj", True),
    "wk": ("self_attn.k_proj", True),
    "wv": ("self_attn.v_proj", True),
    "wo": ("self_attn.o_proj", True),
    "q_norm": ("self_attn.q_norm", False),
    "k_norm": ("self_attn.k_norm", False),
    "mlp_norm": ("post_attention_layernorm", False),
    "w_gate": ("mlp.gate_proj", True),
    "w_up": ("mlp.up_proj", True),
    "w_down": ("mlp.down_proj", True),
}


def _rope_from_hf(hf: dict, name: str) -> tuple[float, RopeScaling | None]:
  """RoPE base and Llama-3.1 scaling from `rope_theta` / `rope_scaling` (transformers 4.x) or from
  `rope_parameters` (transformers 5.x writes theta and scaling there, with rope_type "default" for none)."""
  params = hf.get("rope_parameters") or {}
  theta = float(hf.get("rope_theta", params.get("rope_theta", 10000.0)))
  scaling = hf.get("rope_scaling") or params
  kind = scaling.get("rope_type", scaling.get("type", "default"))
  if kind == "default":
    return theta, None
  if kind != "llama3":
    raise ValueError(f"{name}: rope_scaling type {kind!r} is not supported (only 'llama3')")
  return theta, RopeScaling(
      factor=float(scaling["factor"]),
      low_freq_factor=float(scaling["low_freq_factor"]),
      high_freq_factor=float(scaling["high_freq_factor"]),
      original_max_position=int(scaling["original_max_position_embeddings"]),
  )


def config_from_hf(hf: dict, name: str) -> ModelConfig:
  """ModelConfig from a Hugging Face config.json dict (model_type "llama" or "qwen3")."""
  model_type = hf.get("model_type")
  if model_type not in _MODEL_TYPES:
    raise ValueError(f"{name}: model_type {model_type!r} is not supported (only {_MODEL_TYPES})")
  for flag in ("attention_bias", "mlp_bias"):
    if hf.get(flag):
      raise ValueError(f"{name}: {flag}=true is not supported (the decoder has no biases)")
  if hf.get("hidden_act", "silu") != "silu":
    raise ValueError(f"{name}: hidden_act {hf['hidden_act']!r} is not supported (only 'silu')")
  try:
    rope_theta, rope_scaling = _rope_from_hf(hf, name)
    heads = int(hf["num_attention_heads"])
    kv_heads = hf.get("num_key_value_heads")  # absent or null: one KV head per query head
    return ModelConfig(
        name=name,
        layers=int(hf["num_hidden_layers"]),
        hidden=int(hf["hidden_size"]),
        intermediate=int(hf["intermediate_size"]),
        vocab=int(hf["vocab_size"]),
        q_heads=heads,
        kv_heads=int(heads if kv_heads is None else kv_heads),
        head_dim=int(hf.get("head_dim") or hf["hidden_size"] // heads),
        rope_theta=rope_theta,
        rms_eps=float(hf.get("rms_norm_eps", 1e-6)),
        qk_norm=model_type == "qwen3",
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        rope_scaling=rope_scaling,
        max_position=int(hf.get("max_position_embeddings", 8192)),
    )
  except KeyError as e:
    raise ValueError(f"{name}: config.json lacks {e.args[0]!r}") from None
  except (TypeError, AttributeError, ZeroDivisionError) as e:
    raise ValueError(f"{name}: config.json has a malformed field ({type(e).__name__}: {e})") from None


def config_to_hf(config: ModelConfig) -> dict:
  """The config.json dict `config_from_hf` reads back into `config` (for writing test checkpoints)."""
  hf = dict(
      model_type="qwen3" if config.qk_norm else "llama",
      num_hidden_layers=config.layers, hidden_size=config.hidden, intermediate_size=config.intermediate,
      vocab_size=config.vocab, num_attention_heads=config.q_heads, num_key_value_heads=config.kv_heads,
      head_dim=config.head_dim, rope_theta=config.rope_theta, rms_norm_eps=config.rms_eps,
      tie_word_embeddings=config.tie_embeddings, max_position_embeddings=config.max_position,
  )
  if config.rope_scaling is not None:
    s = config.rope_scaling
    hf["rope_scaling"] = dict(rope_type="llama3", factor=s.factor, low_freq_factor=s.low_freq_factor,
                              high_freq_factor=s.high_freq_factor, original_max_position_embeddings=s.original_max_position)
  return hf


def params_to_hf_tensors(params: DecoderParams) -> dict[str, np.ndarray]:
  """Hugging Face tensor names -> BF16 arrays ([out, in] linear weights), the inverse of loading."""
  out = {"model.embed_tokens.weight": np.asarray(params.embed), "model.norm.weight": np.asarray(params.final_norm)}
  if params.lm_head is not None:
    out["lm_head.weight"] = np.asarray(params.lm_head).T.copy()
  for i, layer in enumerate(params.layers):
    for field, (stem, transpose) in _LAYER_TENSORS.items():
      w = getattr(layer, field)
      if w is not None:
        out[f"model.layers.{i}.{stem}.weight"] = np.asarray(w).T.copy() if transpose else np.asarray(w)
  return out


def _tensor_files(directory: str) -> dict[str, str]:
  """Tensor name -> the safetensors file holding it."""
  index = os.path.join(directory, INDEX_FILE)
  if os.path.isfile(index):
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
      raise ValueError(f"{index}: no weight_map")
    return {k: os.path.join(directory, v) for k, v in weight_map.items()}
  single = os.path.join(directory, SINGLE_FILE)
  if not os.path.isfile(single):
    raise FileNotFoundError(f"{directory}: neither {SINGLE_FILE} nor {INDEX_FILE}")
  with _open(single) as f:
    return {k: single for k in f.keys()}


def _open(path: str):
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{path}: missing safetensors file")
  try:
    return safe_open(path, framework="numpy")
  except (SafetensorError, OSError) as e:
    raise ValueError(f"{path}: not a readable safetensors file ({e})") from e


_FLOAT_DTYPES = ("BF16", "F16", "F32", "F64")  # cast to BF16; anything else (int8, fp8, ...) is quantized
# Tensors a checkpoint may hold that the decoder does not read: RoPE tables of old Llama checkpoints.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


class _Reader(contextlib.ExitStack):
  """Reads tensors by name across shards, opening each file once (closed on exit); records what it read."""

  def __init__(self, directory: str):
    super().__init__()
    self.files = _tensor_files(directory)
    self.handles: dict[str, object] = {}
    self.read: set[str] = set()

  def get(self, name: str, expected: tuple[int, ...], transpose: bool) -> jnp.ndarray:
    path = self.files.get(name)
    if path is None:
      raise ValueError(f"checkpoint lacks tensor {name!r}")
    if path not in self.handles:
      self.handles[path] = self.enter_context(_open(path))
    try:
      dtype = self.handles[path].get_slice(name).get_dtype()
      if dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{path}: tensor {name!r} has dtype {dtype}, expected one of {_FLOAT_DTYPES} "
                         "(quantized checkpoints are not supported)")
      w = self.handles[path].get_tensor(name)
    except (SafetensorError, OSError) as e:
      raise ValueError(f"{path}: cannot read tensor {name!r} ({e})") from e
    w = w.T if transpose else w
    if w.shape != expected:
      raise ValueError(f"{path}: tensor {name!r} has shape {w.shape}, expected {expected}")
    self.read.add(name)
    return jnp.asarray(w, jnp.bfloat16)

  def check_all_read(self, directory: str, config: ModelConfig) -> None:
    """ValueError naming the checkpoint's tensors that loading did not use (a config that does not
    describe the weights: more layers, biases, q/k norms of another architecture, quantization scales)."""
    unused = {n for n in self.files if n not in self.read and not n.endswith(_IGNORED_SUFFIXES)}
    if config.tie_embeddings:
      unused.discard("lm_head.weight")  # tied: Hugging Face ignores a stored copy too
    if unused:
      names = sorted(unused)
      more = f" and {len(names) - 5} more" if len(names) > 5 else ""
      raise ValueError(f"{directory}: checkpoint has tensors that config.json does not account for: "
                       f"{', '.join(names[:5])}{more}")


def load_safetensors(directory: str, name: str | None = None) -> tuple[ModelConfig, DecoderParams]:
  """Config and BF16 params of a Hugging Face checkpoint directory.

  Raises:
    FileNotFoundError: the directory, config.json or a listed shard is missing.
    ValueError: unreadable/corrupted file, unsupported model type, missing, unexpected or
      non-float (quantized) tensor, or wrong shape.
  """
  if not os.path.isdir(directory):
    raise FileNotFoundError(f"{directory}: no such checkpoint directory")
  config = config_from_hf(read_json(os.path.join(directory, "config.json")), name or os.path.basename(directory.rstrip("/")))
  shapes = expected_shapes(config)
  v, h = config.vocab, config.hidden
  with _Reader(directory) as reader:
    layers = []
    for i in range(config.layers):
      fields = dict(q_norm=None, k_norm=None)
      for field, (stem, transpose) in _LAYER_TENSORS.items():
        if field in shapes:
          fields[field] = reader.get(f"model.layers.{i}.{stem}.weight", shapes[field], transpose)
      layers.append(LayerParams(**fields))
    head = None if config.tie_embeddings else reader.get("lm_head.weight", (h, v), transpose=True)
    params = DecoderParams(
        embed=reader.get("model.embed_tokens.weight", (v, h), transpose=False),
        layers=tuple(layers),
        final_norm=reader.get("model.norm.weight", (h,), transpose=False),
        lm_head=head,
    )
    reader.check_all_read(directory, config)
  return config, params


def save_safetensors(directory: str, config: ModelConfig, params: DecoderParams, shards: int = 1) -> None:
  """Write a Hugging Face style checkpoint (config.json + one file, or `shards` files and an index)."""
  from safetensors.numpy import save_file  # writing is for tests and conversions only

  os.makedirs(directory, exist_ok=True)
  with open(os.path.join(directory, "config.json"), "w") as f:
    json.dump(config_to_hf(config), f, indent=1)
  tensors = params_to_hf_tensors(params)
  if shards == 1:
    save_file(tensors, os.path.join(directory, SINGLE_FILE))
    return
  names = sorted(tensors)
  weight_map = {}
  for s in range(shards):
    file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
    part = names[s::shards]
    save_file({n: tensors[n] for n in part}, os.path.join(directory, file))
    weight_map.update({n: file for n in part})
  with open(os.path.join(directory, INDEX_FILE), "w") as f:
    json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)
