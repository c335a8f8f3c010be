"""Decoder models that run on the ZipFusion KV cache (the Flax decoder lands with the model issue)."""

from models.configs import CONFIGS, ModelConfig, get_config

__all__ = ["CONFIGS", "ModelConfig", "get_config"]
