"""Pick weights and a tokenizer for a model named on the command line: a registry name, a GGUF file or
a Hugging Face safetensors directory."""

from __future__ import annotations

import dataclasses

import jax

from models.configs import ModelConfig, get_config
from models.loaders.byte_tokenizer import ByteTokenizer
from models.loaders.gguf_checkpoint import embedded_gguf_path, load_gguf
from models.loaders.safetensors_checkpoint import load_safetensors
from models.loaders.tokenizer import Tokenizer, tokenizer_from_gguf, tokenizer_from_hf_dir
from models.params import DecoderParams, random_params

# Registry names whose weights ship with the installed packages.
EMBEDDED = {"smollm2-135m": embedded_gguf_path}


@dataclasses.dataclass(frozen=True)
class LoadedModel:
  config: ModelConfig
  params: DecoderParams
  tokenizer: Tokenizer | ByteTokenizer
  source: str


def from_gguf(path: str, name: str | None = None) -> LoadedModel:
  config, params, reader = load_gguf(path, name)
  return LoadedModel(config, params, tokenizer_from_gguf(reader), path)


def from_safetensors(directory: str) -> LoadedModel:
  config, params = load_safetensors(directory)
  return LoadedModel(config, params, tokenizer_from_hf_dir(directory), directory)


def from_name(name: str, random_weights: bool = False, seed: int = 0) -> LoadedModel:
  """The embedded weights of a registry name, or random weights (byte tokenizer) when asked for.

  Raises:
    ValueError: unknown name, or a name without weights and `random_weights` not set.
  """
  config = get_config(name)
  if random_weights:
    if config.vocab < 256:
      raise ValueError(f"{name}: random weights use a byte tokenizer, which needs vocab >= 256 (has {config.vocab})")
    return LoadedModel(config, random_params(config, jax.random.key(seed)), ByteTokenizer(), f"random:{seed}")
  if name not in EMBEDDED:
    raise ValueError(
        f"{name}: no weights ship with this package (embedded: {sorted(EMBEDDED)}); "
        "pass --gguf PATH or --safetensors DIR, or --random-weights for a shape-only run"
    )
  return from_gguf(EMBEDDED[name](), name)
