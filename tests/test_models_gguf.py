"""The embedded SmolLM2-135M-Instruct GGUF: config from metadata, q/k rows back in Hugging Face order,
tokenizer, and greedy generation of known-good tokens (recorded from this loader; the text is the
sensible English that only a correct q/k un-permutation gives)."""

import numpy as np
import pytest

from models import get_config
from models.generate_simple import generate
from models.loaders import resolve
from models.loaders.gguf_checkpoint import embedded_gguf_path, open_gguf, unpermute_rows
from test_models_gguf_tiny import llama_cpp_permute
from zipfusion_jax import eligibility_report
from zipfusion_jax.kvstats import format_reports, prompt_kv

PROMPT = "The capital of France is"
PROMPT_IDS = [504, 3575, 282, 4649, 314]
GREEDY_8 = [7042, 30, 198, 198, 504, 2988, 314, 42]  # " Paris.\n\nThe answer is:"


@pytest.fixture(scope="module")
def smollm():
  return resolve.from_name("smollm2-135m")


def test_config_from_metadata_matches_registry(smollm):
  assert smollm.config == get_config("smollm2-135m")
  assert smollm.params.lm_head is None  # tied embeddings
  assert smollm.params.embed.shape == (49152, 576)
  layer = smollm.params.layers[29]
  assert (layer.wq.shape, layer.wk.shape, layer.w_down.shape) == ((576, 576), (576, 192), (1536, 576))
  assert str(layer.wq.dtype) == "bfloat16" and len(smollm.params.layers) == 30


def test_unpermute_inverts_llama_cpp_permute():
  w = np.arange(3 * 64 * 5).reshape(3 * 64, 5)
  np.testing.assert_array_equal(unpermute_rows(llama_cpp_permute(w, 3), 3), w)
  assert not np.array_equal(llama_cpp_permute(w, 3), w)


def test_tokenizer_and_chat_template(smollm):
  tok = smollm.tokenizer
  assert tok.encode(PROMPT) == PROMPT_IDS  # no BOS: the metadata says add_bos_token = false
  assert tok.encode("2024") == [34, 32, 34, 36]  # SmolLM splits digits one by one
  assert tok.decode(tok.encode("héllo wörld\n")) == "héllo wörld\n"
  assert tok.eos_ids == (2,)
  chat = tok.apply_chat_template([{"role": "user", "content": "hi"}])
  assert chat.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
  assert tok.encode_chat("hi")[-4:] == tok.encode("<|im_start|>assistant\n")
  assert tok.encode("<|im_start|>")[0] == 1  # control tokens match whole


def test_greedy_generation_is_known_good(smollm):
  gen = generate(smollm.params, smollm.config, [PROMPT_IDS], 8, eos_ids=smollm.tokenizer.eos_ids)
  assert gen.token_ids == [GREEDY_8]
  assert smollm.tokenizer.decode(GREEDY_8) == " Paris.\n\nThe answer is:"
  # Sampling hot enough to wander, restricted to the one most likely token: greedy again.
  hot = generate(smollm.params, smollm.config, [PROMPT_IDS], 8, eos_ids=smollm.tokenizer.eos_ids, temperature=5.0,
                 top_k=1, seed=3)
  assert hot.token_ids == [GREEDY_8]


def test_kvstats_on_real_kv(smollm):
  ids = PROMPT_IDS + GREEDY_8 + [216, 34, 32, 34]  # 17 tokens -> one complete page (same compiled shapes as above)
  k, v = prompt_kv(smollm.params, smollm.config, ids[:16])
  assert k.shape == v.shape == (30, 3, 16, 64)
  rk, rv = eligibility_report(k, "k"), eligibility_report(v, "v")
  assert rk.pages == 1 and rk.eligible_fraction.shape == (30, 3)
  assert 0.5 < rk.overall_eligible_fraction <= 1 and 12 <= rv.overall_bits_per_value < 16
  assert "K+V:" in format_reports(rk, rv)
  rk2 = eligibility_report(k, "k", version=2)
  assert rk2.version == 2 and np.all(rk2.eligible_fraction >= rk.eligible_fraction)  # one exception never hurts


def test_corrupted_gguf_is_a_clear_error(tmp_path):
  with pytest.raises(FileNotFoundError, match="no such GGUF file"):
    open_gguf(str(tmp_path / "missing.gguf"))
  bad = tmp_path / "truncated.gguf"
  with open(embedded_gguf_path(), "rb") as src, open(bad, "wb") as dst:
    dst.write(src.read(1 << 20))
  with pytest.raises(ValueError, match="truncated.gguf"):
    resolve.from_gguf(str(bad))
  (tmp_path / "garbage.gguf").write_bytes(b"GGUF" + b"\x00" * 100)
  with pytest.raises(ValueError, match="garbage.gguf"):
    open_gguf(str(tmp_path / "garbage.gguf"))


def test_hf_tokenizer_dir_matches_gguf(smollm, tmp_path):
  import json

  from models.loaders.tokenizer import tokenizer_from_hf_dir

  tok = smollm.tokenizer
  tok.backend.save(str(tmp_path / "tokenizer.json"))
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": tok.chat_template}))
  (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0], "bos_token_id": 1}))
  hf = tokenizer_from_hf_dir(str(tmp_path))
  assert hf.encode(PROMPT) == PROMPT_IDS and hf.eos_ids == (2, 0)
  assert hf.encode_chat("hi") == tok.encode_chat("hi")
  (tmp_path / "tokenizer.json").write_text("{")
  with pytest.raises(ValueError, match="tokenizer.json"):
    tokenizer_from_hf_dir(str(tmp_path))


@pytest.mark.slow
def test_batched_chat_and_plain_prompts(smollm):
  tok = smollm.tokenizer
  prompts = [PROMPT_IDS, tok.encode_chat("What is the capital of France?")]
  gen = generate(smollm.params, smollm.config, prompts, 12, eos_ids=tok.eos_ids)
  assert gen.token_ids[0][:8] == GREEDY_8  # a neighbouring slot does not change a greedy continuation
  assert gen.token_ids[1] == [504, 3575, 282, 4649, 314, 7042, 30, 2]  # ends at <|im_end|>
  assert tok.decode(gen.token_ids[1]) == "The capital of France is Paris."


@pytest.mark.slow
def test_cli_end_to_end(tmp_path):
  import json
  import os
  import subprocess
  import sys

  out = tmp_path / "out.json"
  text = tmp_path / "short.txt"
  text.write_text("Hi.")
  env = {**os.environ, "PYTHONPATH": os.getcwd()}
  run = lambda *a: subprocess.run([sys.executable, "-m", *a], capture_output=True, text=True, env=env, timeout=600)
  r = run("zipfusion_jax.generate", "--prompt", PROMPT, "--max-new-tokens", "8", "--json", str(out))
  assert r.returncode == 0, r.stderr
  assert r.stdout == " Paris.\n\nThe answer is:\n" and "tokens/s" in r.stderr
  assert json.loads(out.read_text())["results"][0]["token_ids"] == GREEDY_8
  r = run("zipfusion_jax.kvstats", "--text", str(text))
  assert r.returncode == 2 and "no complete 16-token page" in r.stderr


def _interleaved_rope(x, pos, inv_freq):
  """llama.cpp's LLAMA_ROPE_TYPE_NORM: rotates adjacent pairs (2i, 2i + 1) of x [T, H, D]."""
  ang = pos[:, None, None] * inv_freq[None, None, :]
  even, odd = x[..., 0::2], x[..., 1::2]
  out = np.empty_like(x)
  out[..., 0::2] = even * np.cos(ang) - odd * np.sin(ang)
  out[..., 1::2] = odd * np.cos(ang) + even * np.sin(ang)
  return out


def test_unpermuted_qk_with_rotate_half_rope_equal_llama_cpp_scores(smollm):
  """Attention scores from the GGUF's own q/k rows under llama.cpp's interleaved RoPE equal ours
  (un-permuted rows, rotate-half RoPE): the un-permutation is the right one, not merely plausible."""
  from models.layers import rope_inv_freq
  from models.loaders.gguf_checkpoint import dequantized

  config = smollm.config
  reader = open_gguf(embedded_gguf_path())
  tensors = {t.name: t for t in reader.tensors}
  rng = np.random.default_rng(0)
  x = rng.standard_normal((12, config.hidden)).astype(np.float32)
  pos = np.arange(100, 112, dtype=np.float32)
  inv = rope_inv_freq(config.head_dim, config.rope_theta, None)
  group = config.q_heads // config.kv_heads

  def scores(q, k):  # [T, Hq, D], [T, Hkv, D] -> [Hq, T, T]
    return np.einsum("qhd,khd->hqk", q, np.repeat(k, group, axis=1))

  def rotate_half(x):
    ang = pos[:, None, None] * inv[None, None, :]
    x1, x2 = np.split(x, 2, axis=-1)
    return np.concatenate([x1 * np.cos(ang) - x2 * np.sin(ang), x2 * np.cos(ang) + x1 * np.sin(ang)], -1)

  shape = lambda a, heads: a.reshape(len(x), heads, config.head_dim)
  for layer in (0, 17):
    wq_gguf = dequantized(reader, tensors, f"blk.{layer}.attn_q.weight")  # [out, in], llama.cpp row order
    wk_gguf = dequantized(reader, tensors, f"blk.{layer}.attn_k.weight")
    ref = scores(_interleaved_rope(shape(x @ wq_gguf.T, 9), pos, inv), _interleaved_rope(shape(x @ wk_gguf.T, 3), pos, inv))
    wq = unpermute_rows(wq_gguf, config.q_heads).T
    wk = unpermute_rows(wk_gguf, config.kv_heads).T
    ours = scores(rotate_half(shape(x @ wq, 9)), rotate_half(shape(x @ wk, 3)))
    np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-3 * np.abs(ref).max())
    np.testing.assert_array_equal(np.asarray(smollm.params.layers[layer].wq), np.asarray(wq.astype(smollm.params.embed.dtype)))
    wrong = scores(rotate_half(shape(x @ wq_gguf.T, 9)), rotate_half(shape(x @ wk_gguf.T, 3)))
    assert np.abs(wrong - ref).max() > 0.1 * np.abs(ref).max()  # skipping the un-permutation is caught
