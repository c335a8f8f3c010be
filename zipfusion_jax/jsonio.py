"""Write JSON results all at once: a temporary file next to the target, then a rename."""

from __future__ import annotations

import json
import os
import tempfile


def write_json_atomic(path: str, payload: dict) -> None:
  """Write `payload` to `path` so that readers see either the old file or the complete new one."""
  directory = os.path.dirname(os.path.abspath(path))
  fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=directory)
  try:
    with os.fdopen(fd, "w") as f:
      json.dump(payload, f, indent=1)
    os.replace(tmp, path)
  except BaseException:
    os.unlink(tmp)
    raise
