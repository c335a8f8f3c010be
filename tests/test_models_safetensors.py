"""Hugging Face safetensors checkpoints load back exactly; broken ones fail with the path and reason."""

import json
import os

import chex
import jax
import pytest

from models import get_config
from models.loaders.safetensors_checkpoint import load_safetensors, save_safetensors
from models.params import random_params


@pytest.mark.parametrize("name, shards", [("tiny-llama3", 1), ("tiny-qwen3", 1), ("tiny-llama3", 3), ("tiny-qwen3", 2)])
def test_round_trip_single_and_sharded(tmp_path, name, shards):
  config = get_config(name)
  params = random_params(config, jax.random.key(3))
  save_safetensors(str(tmp_path), config, params, shards=shards)
  assert os.path.isfile(tmp_path / "model.safetensors.index.json") == (shards > 1)
  loaded_config, loaded = load_safetensors(str(tmp_path), name=name)
  assert loaded_config == config
  chex.assert_trees_all_equal(loaded, params)
  assert (loaded.lm_head is None) == config.tie_embeddings
  assert (loaded.layers[0].q_norm is None) == (not config.qk_norm)


@pytest.fixture
def checkpoint(tmp_path):
  config = get_config("tiny-llama3")
  save_safetensors(str(tmp_path), config, random_params(config, jax.random.key(0)), shards=2)
  return tmp_path


def test_truncated_shard_is_a_clear_error(checkpoint):
  shard = checkpoint / "model-00002-of-00002.safetensors"
  data = shard.read_bytes()
  shard.write_bytes(data[: len(data) // 2])
  with pytest.raises(ValueError, match="model-00002-of-00002.safetensors"):
    load_safetensors(str(checkpoint))


def test_garbage_header_is_a_clear_error(checkpoint):
  (checkpoint / "model-00001-of-00002.safetensors").write_bytes(b"\xff" * 64)
  with pytest.raises(ValueError, match="not a readable safetensors file"):
    load_safetensors(str(checkpoint))


def test_missing_shard_and_tensor(checkpoint):
  index = json.loads((checkpoint / "model.safetensors.index.json").read_text())
  index["weight_map"].pop("model.layers.1.mlp.up_proj.weight")
  (checkpoint / "model.safetensors.index.json").write_text(json.dumps(index))
  with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight"):
    load_safetensors(str(checkpoint))
  os.remove(checkpoint / "model-00001-of-00002.safetensors")
  with pytest.raises(FileNotFoundError, match="model-00001-of-00002.safetensors"):
    load_safetensors(str(checkpoint))


def test_bad_config(checkpoint, tmp_path_factory):
  with pytest.raises(FileNotFoundError, match="no such checkpoint directory"):
    load_safetensors(str(checkpoint / "nope"))
  empty = tmp_path_factory.mktemp("empty")
  with pytest.raises(FileNotFoundError, match="config.json"):
    load_safetensors(str(empty))
  config_path = checkpoint / "config.json"
  hf = json.loads(config_path.read_text())
  config_path.write_text(json.dumps({**hf, "model_type": "gpt2"}))
  with pytest.raises(ValueError, match="model_type 'gpt2'"):
    load_safetensors(str(checkpoint))
  config_path.write_text(json.dumps({**hf, "attention_bias": True}))
  with pytest.raises(ValueError, match="attention_bias"):
    load_safetensors(str(checkpoint))
  config_path.write_text(json.dumps({**hf, "hidden_size": 128}))
  with pytest.raises(ValueError, match="has shape"):
    load_safetensors(str(checkpoint))
  config_path.write_text("{not json")
  with pytest.raises(ValueError, match="not valid JSON"):
    load_safetensors(str(checkpoint))
