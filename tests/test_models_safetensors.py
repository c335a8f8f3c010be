"""Hugging Face safetensors checkpoints load back exactly; broken ones fail with the path and reason."""

import dataclasses
import json
import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
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


def _rewrite(directory, edit_tensors=None, edit_config=None):
  """Rewrite a single-file checkpoint's tensors and / or config.json in place."""
  from safetensors.numpy import load_file, save_file

  if edit_tensors is not None:
    path = str(directory / "model.safetensors")
    save_file(edit_tensors(load_file(path)), path)
  if edit_config is not None:
    hf = json.loads((directory / "config.json").read_text())
    edit_config(hf)
    (directory / "config.json").write_text(json.dumps(hf))


@pytest.fixture
def single(tmp_path):
  config = get_config("tiny-llama3")
  params = random_params(config, jax.random.key(0))
  save_safetensors(str(tmp_path), config, params)
  return tmp_path, config, params


@pytest.mark.parametrize("extra", ["model.layers.2.mlp.up_proj.weight", "model.layers.0.self_attn.q_proj.bias",
                                   "model.layers.1.self_attn.q_norm.weight"])
def test_tensors_the_config_does_not_use_are_refused(single, extra):
  # A third layer, attention biases or Qwen3 q/k norms under a Llama config: loading the rest would be garbage.
  directory, _, _ = single
  _rewrite(directory, lambda t: {**t, extra: t["model.layers.0.input_layernorm.weight"]})
  with pytest.raises(ValueError, match="does not account for: " + extra.replace(".", r"\.")):
    load_safetensors(str(directory))


def test_config_with_fewer_layers_than_the_checkpoint_is_refused(single):
  directory, _, _ = single
  _rewrite(directory, edit_config=lambda hf: hf.update(num_hidden_layers=1))
  with pytest.raises(ValueError, match=r"model\.layers\.1\..* and 4 more"):
    load_safetensors(str(directory))


def test_harmless_extra_tensors_load(single):
  # Old Llama checkpoints store RoPE tables; a tied checkpoint may keep a copy of the embedding as lm_head.
  directory, config, params = single
  tied = dataclasses.replace(config, tie_embeddings=True)

  def add(t):
    return {**t, "model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(32, np.float32),
            "lm_head.weight": t["model.embed_tokens.weight"]}

  save_safetensors(str(directory), tied, params.replace(lm_head=None))
  _rewrite(directory, add)
  loaded_config, loaded = load_safetensors(str(directory), name=config.name)
  assert loaded_config == tied and loaded.lm_head is None
  chex.assert_trees_all_equal(loaded.embed, params.embed)


def test_float_dtypes_are_cast_and_integer_ones_refused(single):
  directory, _, params = single
  _rewrite(directory, lambda t: {k: v.astype(np.float32) for k, v in t.items()})
  chex.assert_trees_all_equal(load_safetensors(str(directory))[1], params)  # BF16 -> F32 -> BF16 is exact
  _rewrite(directory, lambda t: {**t, "model.norm.weight": t["model.norm.weight"].astype(np.float16)})
  assert load_safetensors(str(directory))[1].final_norm.dtype == jnp.bfloat16
  _rewrite(directory, lambda t: {**t, "model.layers.1.mlp.down_proj.weight": np.ones((96, 192), np.int8)})
  with pytest.raises(ValueError, match=r"down_proj\.weight' has dtype I8"):
    load_safetensors(str(directory))


def test_config_json_rope_and_head_fields(single):
  directory, config, _ = single

  def loaded(edit):
    _rewrite(directory, edit_config=edit)
    return load_safetensors(str(directory), name=config.name)[0]

  # transformers 5 writes rope_theta and the scaling under rope_parameters.
  def v5(hf):
    hf["rope_parameters"] = dict(rope_theta=hf.pop("rope_theta"), **hf.pop("rope_scaling"))
  assert loaded(v5) == config
  no_scaling = dataclasses.replace(config, rope_scaling=None)
  assert loaded(lambda hf: hf["rope_parameters"].update(rope_type="default")) == no_scaling
  assert loaded(lambda hf: hf.update(rope_scaling={"rope_type": "default"})) == no_scaling
  assert loaded(lambda hf: hf.update(rope_scaling=None)) == no_scaling
  with pytest.raises(ValueError, match="rope_scaling type 'yarn'"):
    loaded(lambda hf: hf.update(rope_scaling={"rope_type": "yarn", "factor": 4.0}))
  with pytest.raises(ValueError, match="lacks 'original_max_position_embeddings'"):
    loaded(lambda hf: hf.update(rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                              "high_freq_factor": 4.0}))
  with pytest.raises(ValueError, match="kv_heads"):
    loaded(lambda hf: hf.update(rope_scaling=None, num_key_value_heads=0))
  with pytest.raises(ValueError, match="k_proj.weight' has shape"):  # null: one KV head per query head
    loaded(lambda hf: hf.update(num_key_value_heads=None))


def test_hf_chat_template_gets_one_bos(tmp_path):
  # tokenizer.json's post-processor adds BOS and the chat template writes it too: encode_chat must not double it.
  import tokenizers
  from tokenizers import models as tokenizer_models
  from tokenizers import pre_tokenizers, processors

  from models.loaders.tokenizer import tokenizer_from_hf_dir

  backend = tokenizers.Tokenizer(tokenizer_models.WordLevel({"<s>": 0, "</s>": 1, "hi": 2, "user:": 3, "[UNK]": 4},
                                                            unk_token="[UNK]"))
  backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  backend.add_special_tokens(["<s>", "</s>"])
  backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
  backend.save(str(tmp_path / "tokenizer.json"))
  template = "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} {% endfor %}"
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
  (tmp_path / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1}))
  tok = tokenizer_from_hf_dir(str(tmp_path))
  assert tok.encode("hi") == [0, 2]  # plain prompts keep the post-processor's BOS
  assert tok.encode_chat("hi") == [0, 3, 2]
