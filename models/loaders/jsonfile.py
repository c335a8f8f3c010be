"""Read a checkpoint's JSON side files with errors that name the path."""

from __future__ import annotations

import json
import os


def read_json(path: str, required: bool = True) -> dict:
  """The parsed file; {} when it is absent and not required.

  Raises:
    FileNotFoundError: a required file is missing. ValueError: the file is not valid JSON.
  """
  if not os.path.isfile(path):
    if required:
      raise FileNotFoundError(f"{path}: missing")
    return {}
  try:
    with open(path) as f:
      return json.load(f)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ValueError(f"{path}: not valid JSON ({e})") from e
