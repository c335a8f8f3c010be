"""Decoder models that run on the ZipFusion KV cache.

`configs` (named shapes), `params` (the BF16 weight pytree), `layers` + `decoder` (pure-function
Llama-3.1 / Qwen3 prefill and decode over a `zipfusion_jax.kv_ops.KVBackend`; no NNX or Linen
modules), `reference` (fp32 full-sequence forward), `dense_backend` (an uncompressed reference
backend), `generate_simple` (generation over it), `loaders/` (GGUF, safetensors, tokenizers).
"""

from models.configs import CONFIGS, ModelConfig, RopeScaling, get_config

__all__ = ["CONFIGS", "ModelConfig", "RopeScaling", "get_config"]
