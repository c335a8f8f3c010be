"""ZipFusion-JAX: a lossless 12-bit KV cache decoded inside paged decode attention."""

from __future__ import annotations

from typing import Literal

from zipfusion_jax.format.codec import CompressedBlocks, canonical_order, compress_reference, decompress_reference
from zipfusion_jax.format.validate import FormatError, validate
from zipfusion_jax.paged.api import decompress_then_attend, paged_decode_attention
from zipfusion_jax.paged.cache import PagedKVCache, paged_cache_from_dense, restore_pages
from zipfusion_jax.telemetry import EligibilityReport, eligibility_report

__version__ = "0.1.0"

Impl = Literal["reference", "pallas"]


def compress(x, impl: Impl = "reference", version: int = 1, **kwargs) -> CompressedBlocks:
  """Compress BF16 blocks losslessly.

  Args:
    x: bfloat16 [..., 512] (numpy or jax); each trailing row is one block.
    impl: "reference" (jnp, the spec) or "pallas" (the compression kernel;
      interpreted when no GPU is present). Both give identical bytes.
    version: format version (docs/FORMAT.md): 1, or 2 (one exception per block,
      16-byte group records).
    **kwargs: for "pallas": `config`, `interpret`.

  Returns:
    CompressedBlocks with `.compressible` bool [...] and `.nbytes`.

  Raises:
    TypeError: x is not bfloat16. ValueError: trailing size is not 512, or an
    unknown version. NotImplementedError: version 2 with the single-pass kernel config.
  """
  if impl == "reference":
    if kwargs:
      raise TypeError(f"impl='reference' takes no options, got {sorted(kwargs)}")
    return compress_reference(x, version)
  if impl == "pallas":
    from pallas_kernels.compress import compress_pallas  # kernels sit above the format

    return compress_pallas(x, version=version, **kwargs)
  raise ValueError(f"{impl=} must be 'reference' or 'pallas'")


def decompress(c: CompressedBlocks):
  """Restore the exact BF16 blocks: bfloat16 [*batch_shape, 512]."""
  return decompress_reference(c)


__all__ = [
    "CompressedBlocks",
    "EligibilityReport",
    "FormatError",
    "PagedKVCache",
    "canonical_order",
    "compress",
    "decompress",
    "decompress_then_attend",
    "eligibility_report",
    "paged_cache_from_dense",
    "paged_decode_attention",
    "restore_pages",
    "validate",
]
