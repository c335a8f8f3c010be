"""A stand-in tokenizer for random-weight models: token ids are the UTF-8 bytes of the text."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ByteTokenizer:
  """ids = UTF-8 bytes (needs vocab >= 256); no BOS, EOS or chat template."""

  bos_id: None = None
  add_bos: bool = False
  eos_ids: tuple[int, ...] = ()
  chat_template: None = None

  def encode(self, text: str) -> list[int]:
    return list(text.encode("utf-8"))

  def decode(self, ids) -> str:
    return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

  def encode_chat(self, prompt: str) -> list[int]:
    raise ValueError("random weights have no chat template (drop --chat)")
