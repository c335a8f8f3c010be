"""Tiny random Llama and Qwen3 GGUF files written the way llama.cpp's converter writes them load back exactly."""

import dataclasses

import chex
import gguf
import jax
import numpy as np
import pytest

from models import get_config
from models.layers import rope_inv_freq
from models.loaders.gguf_checkpoint import load_gguf
from models.params import random_params


def llama_cpp_permute(w, heads):  # convert_hf_to_gguf.py, LlamaModel.permute (rows [heads * D, in])
  return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path, config, params, arch, rope_scaling_type=None):
  """Metadata and F32 tensors as convert_hf_to_gguf.py writes them (Llama-3.1 scaling as rope_freqs divisors)."""
  w = gguf.GGUFWriter(str(path), arch)
  w.add_block_count(config.layers)
  w.add_context_length(config.max_position)
  w.add_embedding_length(config.hidden)
  w.add_feed_forward_length(config.intermediate)
  w.add_head_count(config.q_heads)
  w.add_head_count_kv(config.kv_heads)
  w.add_key_length(config.head_dim)
  w.add_rope_freq_base(config.rope_theta)
  w.add_layer_norm_rms_eps(config.rms_eps)
  w.add_vocab_size(config.vocab)
  if rope_scaling_type:
    w.add_rope_scaling_type(gguf.RopeScalingType(rope_scaling_type))
  f32 = lambda a: np.asarray(a, np.float32)
  if config.rope_scaling is not None:
    plain = rope_inv_freq(config.head_dim, config.rope_theta, None)
    w.add_tensor("rope_freqs.weight", plain / rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling))
    w.add_uint32(f"{arch}.rope.scaling.original_context_length", config.rope_scaling.original_max_position)
  w.add_tensor("token_embd.weight", f32(params.embed))
  w.add_tensor("output_norm.weight", f32(params.final_norm))
  if params.lm_head is not None:
    w.add_tensor("output.weight", f32(params.lm_head).T.copy())
  names = dict(attn_norm="attn_norm", wq="attn_q", wk="attn_k", wv="attn_v", wo="attn_output", q_norm="attn_q_norm",
               k_norm="attn_k_norm", mlp_norm="ffn_norm", w_gate="ffn_gate", w_up="ffn_up", w_down="ffn_down")
  for i, layer in enumerate(params.layers):
    for field, suffix in names.items():
      a = getattr(layer, field)
      if a is None:
        continue
      a = f32(a) if a.ndim == 1 else f32(a).T.copy()  # [out, in] as in the file
      if arch == "llama" and field in ("wq", "wk"):
        a = llama_cpp_permute(a, config.q_heads if field == "wq" else config.kv_heads)
      w.add_tensor(f"blk.{i}.{suffix}.weight", a)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()


@pytest.mark.parametrize("name, arch", [("tiny-llama3", "llama"), ("tiny-qwen3", "qwen3")])
def test_tiny_gguf_round_trip(tmp_path, name, arch):
  config = get_config(name)
  params = random_params(config, jax.random.key(5))
  write_gguf(tmp_path / "m.gguf", config, params, arch)
  loaded_config, loaded, _ = load_gguf(str(tmp_path / "m.gguf"), name=config.name)
  assert loaded_config == config
  chex.assert_trees_all_equal(loaded, params)  # BF16 -> F32 file -> BF16 is exact


def test_unsupported_rope_scaling_is_refused(tmp_path):
  config = dataclasses.replace(get_config("tiny-llama3"), rope_scaling=None)
  write_gguf(tmp_path / "m.gguf", config, random_params(config, jax.random.key(0)), "llama", rope_scaling_type="yarn")
  with pytest.raises(ValueError, match="RoPE scaling 'yarn'"):
    load_gguf(str(tmp_path / "m.gguf"))


def test_rope_freqs_off_the_llama31_rule_are_refused(tmp_path):
  config = get_config("tiny-llama3")
  bent = dataclasses.replace(config, rope_scaling=dataclasses.replace(config.rope_scaling, high_freq_factor=2.0))
  write_gguf(tmp_path / "m.gguf", bent, random_params(config, jax.random.key(0)), "llama")
  with pytest.raises(ValueError, match="does not follow the Llama-3.1 scaling rule"):
    load_gguf(str(tmp_path / "m.gguf"))
