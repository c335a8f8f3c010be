"""Page layout: which 512 values of a 16-token page form each block, in which order.

A page holds `PAGE_SIZE` tokens x `head_dim` values of one layer, one KV head,
K or V. Block j of a page covers dims [32 j, 32 j + 32) of all 16 tokens,
so head_dim 128 gives four blocks and head_dim 64 two. Inside a block the
values are ordered as two 16x16 *fragment tiles* (c = 0, 1), each tile in the
register order of a Hopper wgmma / mma.m16n8k16 A-operand fragment, so the
eight values one thread feeds to a tensor-core instruction are contiguous:

  tile element M[row, col] (row, col in 0..15) sits at position
    c * 256 + lane * 8 + i,   lane = (row % 8) * 4 + (col % 8) // 2,
                              i    = (col // 8) * 4 + (row // 8) * 2 + col % 2

K is the A operand of S^T = K Q^T (rows = tokens, cols = dims):
  tile c of K block j: M[row, col] = K[token=row, dim=32 j + 16 c + col]
V is the A operand of O^T = V^T P^T (rows = dims, cols = tokens):
  tile c of V block j: M[row, col] = V[token=col, dim=32 j + 16 c + row]
"""

from __future__ import annotations

import functools
from typing import Literal

import numpy as np
import jax.numpy as jnp

from zipfusion_jax.format.block import VALUES_PER_BLOCK

PAGE_SIZE = 16
DIMS_PER_BLOCK = VALUES_PER_BLOCK // PAGE_SIZE  # 32
TILE = 16
SUPPORTED_HEAD_DIMS = (64, 128)

Kind = Literal["k", "v"]


def blocks_per_page(head_dim: int) -> int:
  check_head_dim(head_dim)
  return head_dim // DIMS_PER_BLOCK


def check_head_dim(head_dim: int) -> None:
  if head_dim not in SUPPORTED_HEAD_DIMS:
    raise ValueError(f"{head_dim=} is not supported; expected one of {SUPPORTED_HEAD_DIMS}")


def tile_position(row: np.ndarray, col: np.ndarray) -> np.ndarray:
  """Position (0..255) of element [row, col] of a 16x16 fragment tile."""
  lane = (row % 8) * 4 + (col % 8) // 2
  i = (col // 8) * 4 + (row // 8) * 2 + col % 2
  return lane * 8 + i


@functools.lru_cache(maxsize=None)
def page_permutation(kind: Kind, head_dim: int) -> np.ndarray:
  """int32 [head_dim // 32, 512]: flat page index (token * head_dim + dim) per block position."""
  if kind not in ("k", "v"):
    raise ValueError(f"{kind=} must be 'k' or 'v'")
  nblocks = blocks_per_page(head_dim)
  perm = np.empty((nblocks, VALUES_PER_BLOCK), np.int32)
  row, col = np.meshgrid(np.arange(TILE), np.arange(TILE), indexing="ij")
  pos = tile_position(row, col)
  for j in range(nblocks):
    for c in range(2):
      dim0 = j * DIMS_PER_BLOCK + c * TILE
      token, dim = (row, dim0 + col) if kind == "k" else (col, dim0 + row)
      perm[j, c * 256 + pos] = token * head_dim + dim
  perm.setflags(write=False)
  return perm


@functools.lru_cache(maxsize=None)
def inverse_page_permutation(kind: Kind, head_dim: int) -> np.ndarray:
  """int32 [16 * head_dim]: flat block-major position of each page element."""
  inv = np.empty(PAGE_SIZE * head_dim, np.int32)
  inv[page_permutation(kind, head_dim).reshape(-1)] = np.arange(PAGE_SIZE * head_dim, dtype=np.int32)
  inv.setflags(write=False)
  return inv


def split_pages(x: jnp.ndarray) -> jnp.ndarray:
  """[..., tokens, head_dim] -> [..., tokens // 16, 16, head_dim]: the complete pages.

  Tail tokens of an incomplete last page are dropped (they stay raw in a cache).
  """
  *lead, tokens, head_dim = x.shape
  pages = tokens // PAGE_SIZE
  return x[..., : pages * PAGE_SIZE, :].reshape(*lead, pages, PAGE_SIZE, head_dim)


# The position order is a permutation of index bits, so pages <-> blocks is a reshape and a
# transpose (no gather). A block's position bits, high to low, are
#   c | row % 8 (3) | (col % 8) // 2 (2) | col // 8 | row // 8 | col % 2
# = axes (c, r_lo, c_mid, c_hi, r_hi, c_lo) of sizes (2, 8, 4, 2, 2, 2); block j adds axis j.
_BLOCK_AXES = (2, 8, 4, 2, 2, 2)  # c, r_lo, c_mid, c_hi, r_hi, c_lo
# Page axes in row-major (token, dim) order, as indices into (j, c, r_lo, c_mid, c_hi, r_hi, c_lo):
#   K: token = (r_hi, r_lo), dim = (j, c, c_hi, c_mid, c_lo)
#   V: token = (c_hi, c_mid, c_lo), dim = (j, c, r_hi, r_lo)
_PAGE_ORDER = {"k": (5, 2, 0, 1, 4, 3, 6), "v": (4, 3, 6, 0, 1, 5, 2)}


def _check_kind(kind: Kind) -> None:
  if kind not in ("k", "v"):
    raise ValueError(f"{kind=} must be 'k' or 'v'")


def pages_to_blocks(pages: jnp.ndarray, kind: Kind) -> jnp.ndarray:
  """[..., 16, head_dim] -> [..., head_dim // 32, 512] in block position order."""
  _check_kind(kind)
  head_dim = pages.shape[-1]
  if pages.shape[-2] != PAGE_SIZE:
    raise ValueError(f"pages must have {PAGE_SIZE} tokens on axis -2, got shape {pages.shape}")
  nblocks = blocks_per_page(head_dim)
  lead = pages.shape[:-2]
  order = _PAGE_ORDER[kind]
  block_shape = (nblocks, *_BLOCK_AXES)
  x = pages.reshape(*lead, *(block_shape[a] for a in order))
  inverse = tuple(order.index(a) for a in range(len(order)))
  x = jnp.transpose(x, (*range(len(lead)), *(len(lead) + a for a in inverse)))
  return x.reshape(*lead, nblocks, VALUES_PER_BLOCK)


def blocks_to_pages(blocks: jnp.ndarray, kind: Kind) -> jnp.ndarray:
  """[..., head_dim // 32, 512] -> [..., 16, head_dim]; inverse of `pages_to_blocks`."""
  _check_kind(kind)
  nblocks = blocks.shape[-2]
  head_dim = nblocks * DIMS_PER_BLOCK
  check_head_dim(head_dim)
  lead = blocks.shape[:-2]
  x = blocks.reshape(*lead, nblocks, *_BLOCK_AXES)
  x = jnp.transpose(x, (*range(len(lead)), *(len(lead) + a for a in _PAGE_ORDER[kind])))
  return x.reshape(*lead, PAGE_SIZE, head_dim)
