"""Eligibility telemetry: how much of a KV tensor the 12-bit format covers."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from zipfusion_jax.format import block as B
from zipfusion_jax.format import layout
from zipfusion_jax.format.codec import check_version
from zipfusion_jax.format.layout import Kind


@dataclasses.dataclass(frozen=True)
class EligibilityReport:
  """Per layer and KV head statistics over the complete pages of one of K or V.

  Attributes:
    kind: "k" or "v".
    version: the format version measured (1, or 2: one exception per block).
    eligible_fraction: float64 [layers, kv_heads], share of 512-value blocks
      stored in 12 bits.
    bits_per_value: float64 [layers, kv_heads], stored bits per BF16 value:
      payload plus 8 bytes (version 2: 16) of metadata per group of 4
      consecutive blocks of one (layer, head), as `compress` groups them (one
      page for head_dim 128, two pages for head_dim 64).
    pages: complete 16-token pages per (layer, head) that were measured; tail
      tokens of an incomplete page stay raw and are not counted.
  """

  kind: str
  eligible_fraction: np.ndarray
  bits_per_value: np.ndarray
  pages: int
  version: int = 1

  @property
  def overall_eligible_fraction(self) -> float:
    return float(self.eligible_fraction.mean())

  @property
  def overall_bits_per_value(self) -> float:
    return float(self.bits_per_value.mean())

  @property
  def compression_ratio(self) -> float:
    return 16.0 / self.overall_bits_per_value


@functools.partial(jax.jit, static_argnums=1)
def _block_eligibility(blocks_bits: jax.Array, version: int) -> jax.Array:
  if version == 1:
    return B.block_half_base(blocks_bits)[0]
  return B.is_compressed(B.block_rule_v2(blocks_bits)[0])


def eligibility_report(x, kind: Kind, version: int = 1) -> EligibilityReport:
  """Measure the block rule on a KV tensor.

  Args:
    x: bfloat16 [layers, kv_heads, tokens, head_dim] (K or V of a sequence).
    kind: "k" or "v" (selects the page layout).
    version: format version whose rule and metadata size are measured (1 or 2).
  """
  version = check_version(version)
  if jnp.dtype(getattr(x, "dtype", None)) != jnp.bfloat16:
    raise TypeError(f"eligibility_report expects bfloat16, got {getattr(x, 'dtype', None)}")
  if x.ndim != 4:
    raise ValueError(f"expected [layers, kv_heads, tokens, head_dim], got shape {x.shape}")
  *_, tokens, head_dim = x.shape
  layout.check_head_dim(head_dim)
  pages = tokens // layout.PAGE_SIZE
  if pages == 0:
    raise ValueError(f"{tokens=} holds no complete {layout.PAGE_SIZE}-token page")
  paged = layout.split_pages(jnp.asarray(x))
  blocks = layout.pages_to_blocks(paged, kind)  # [L, H, P, nb, 512]
  eligible = np.asarray(_block_eligibility(B.to_bits(blocks), version))
  units = np.where(eligible, B.COMPRESSED_UNITS, B.RAW_UNITS)
  groups = -(-pages * blocks.shape[3] // B.BLOCKS_PER_GROUP)
  meta_bytes = B.GROUP_RECORD_BYTES[version]
  stored = units.sum(axis=(2, 3)) * B.UNIT_BYTES + groups * meta_bytes
  values = pages * layout.PAGE_SIZE * head_dim
  return EligibilityReport(
      kind=kind,
      eligible_fraction=eligible.mean(axis=(2, 3)).astype(np.float64),
      bits_per_value=stored * 8.0 / values,
      pages=pages,
      version=version,
  )
