"""Tokenizers from GGUF metadata (byte-level BPE) or a Hugging Face `tokenizer.json`, plus chat templates.

GGUF: `tokenizer.ggml.tokens` / `merges` become a `tokenizers` BPE model with the pre-tokenizer
llama.cpp uses for `tokenizer.ggml.pre`; control tokens are special (matched whole in text, skipped
when decoding). BOS is prepended only when the metadata says `add_bos_token`.
"""

from __future__ import annotations

import dataclasses
import os

import jinja2.sandbox
import tokenizers
from tokenizers import decoders, pre_tokenizers
from tokenizers import models as tokenizer_models

from models.loaders.jsonfile import read_json

# llama.cpp's pre-tokenizer regexes (llama-vocab.cpp) for the GGUF `tokenizer.ggml.pre` names we support.
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_CONTROL, _USER_DEFINED = 3, 4


def _pre_tokenizer(pre: str):
  byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
  split = lambda regex: pre_tokenizers.Split(tokenizers.Regex(regex), behavior="isolated")
  if pre in ("gpt2", "default"):
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  if pre == "smollm":  # each digit alone, then the GPT-2 regex
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    )
  if pre in ("llama-bpe", "llama3"):
    return pre_tokenizers.Sequence([split(_LLAMA3_REGEX), byte_level])
  if pre in ("qwen2", "qwen3"):
    return pre_tokenizers.Sequence([split(_QWEN2_REGEX), byte_level])
  raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported")


@dataclasses.dataclass(frozen=True)
class Tokenizer:
  """Text <-> token ids, with the model's BOS/EOS and chat template.

  Attributes:
    backend: the `tokenizers.Tokenizer`.
    bos_id: BOS token id or None; add_bos: prepend it in `encode` (GGUF `add_bos_token`).
    eos_ids: ids that end generation.
    chat_template: Jinja2 chat template source, or None.
  """

  backend: tokenizers.Tokenizer
  bos_id: int | None
  add_bos: bool
  eos_ids: tuple[int, ...]
  chat_template: str | None = None

  def encode(self, text: str) -> list[int]:
    ids = self.backend.encode(text).ids
    return [self.bos_id, *ids] if self.add_bos and self.bos_id is not None else ids

  def decode(self, ids) -> str:
    return self.backend.decode(list(ids), skip_special_tokens=True)

  def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
    """Render `[{"role": ..., "content": ...}]` with the model's template (Hugging Face conventions)."""
    if self.chat_template is None:
      raise ValueError("this tokenizer has no chat template")
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

    def raise_exception(message):
      raise ValueError(f"chat template: {message}")

    env.globals["raise_exception"] = raise_exception
    token = lambda i: None if i is None else self.backend.id_to_token(i)
    return env.from_string(self.chat_template).render(
        messages=messages,
        add_generation_prompt=add_generation_prompt,
        bos_token=token(self.bos_id) or "",
        eos_token=token(self.eos_ids[0]) if self.eos_ids else "",
    )

  def encode_chat(self, prompt: str) -> list[int]:
    """One user turn rendered by the chat template, ready for the assistant's reply.

    The template writes its own special tokens (BOS included), so the text is encoded without the
    tokenizer's post-processor (as Hugging Face's `apply_chat_template` does): a `tokenizer.json`
    that adds BOS would otherwise give two.
    """
    text = self.apply_chat_template([{"role": "user", "content": prompt}])
    ids = self.backend.encode(text, add_special_tokens=False).ids
    if self.add_bos and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
      ids = [self.bos_id, *ids]
    return ids


def tokenizer_from_gguf(reader) -> Tokenizer:
  """Byte-level BPE tokenizer from a GGUFReader's `tokenizer.ggml.*` metadata."""
  fields = reader.fields
  where = reader.data.filename

  def get(key, default=None):
    f = fields.get(key)
    return default if f is None else f.contents()

  model = get("tokenizer.ggml.model")
  if model != "gpt2":
    raise ValueError(f"{where}: tokenizer model {model!r} is not supported (only byte-level BPE, 'gpt2')")
  tokens, merges = get("tokenizer.ggml.tokens"), get("tokenizer.ggml.merges")
  if not tokens or merges is None:
    raise ValueError(f"{where}: GGUF metadata lacks tokenizer.ggml.tokens or merges")
  types = get("tokenizer.ggml.token_type", [1] * len(tokens))
  bpe = tokenizer_models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[tuple(m.split(" ", 1)) for m in merges])
  tok = tokenizers.Tokenizer(bpe)
  tok.pre_tokenizer = _pre_tokenizer(get("tokenizer.ggml.pre", "gpt2"))
  tok.decoder = decoders.ByteLevel()
  tok.add_special_tokens(
      [tokenizers.AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == _CONTROL]
  )
  tok.add_tokens(
      [tokenizers.AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == _USER_DEFINED]
  )
  eos = get("tokenizer.ggml.eos_token_id")
  eot = get("tokenizer.ggml.eot_token_id")
  return Tokenizer(
      backend=tok,
      bos_id=get("tokenizer.ggml.bos_token_id"),
      add_bos=bool(get("tokenizer.ggml.add_bos_token", False)),
      eos_ids=tuple(dict.fromkeys(i for i in (eos, eot) if i is not None)),
      chat_template=get("tokenizer.chat_template"),
  )


def tokenizer_from_hf_dir(directory: str) -> Tokenizer:
  """Tokenizer from `tokenizer.json` (its post-processor adds BOS where the model wants one),
  EOS from generation_config.json / config.json, chat template from tokenizer_config.json."""
  path = os.path.join(directory, "tokenizer.json")
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{path}: missing")
  try:
    backend = tokenizers.Tokenizer.from_file(path)
  except Exception as e:
    raise ValueError(f"{path}: not a readable tokenizer.json ({e})") from e
  tok_config = read_json(os.path.join(directory, "tokenizer_config.json"), required=False)
  gen = read_json(os.path.join(directory, "generation_config.json"), required=False)
  cfg = read_json(os.path.join(directory, "config.json"), required=False)
  eos = gen.get("eos_token_id", cfg.get("eos_token_id"))
  eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
  template = tok_config.get("chat_template")
  if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
    template = next((t["template"] for t in template if t.get("name") == "default"), None)
  return Tokenizer(backend=backend, bos_id=gen.get("bos_token_id", cfg.get("bos_token_id")), add_bos=False,
                   eos_ids=eos_ids, chat_template=template)
