"""Interpret-mode stand-ins for the decode kernel's inline Mosaic GPU code (CPU tests).

Inline PTX cannot be interpreted, so off-GPU `decode_attention.py` swaps in these jnp
versions of the same work on the same SMEM buffers:

* `restore_tiles` for `restore_mgpu.restore_k` / `restore_vt`: the jnp codec decodes the
  byte stage into the BF16 tiles (the consumer then reads K and V^T from SMEM, as on the
  uncompressed path);
* `gather_pages` for `page_prefetch_mgpu.gather_pages`: the same chunk, one entry at a time.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import page_prefetch_mgpu as P
from pallas_kernels import restore_mgpu as R
from zipfusion_jax.format import block as FB
from zipfusion_jax.format import codec
from zipfusion_jax.format import layout as FL

PAGE = R.PAGE


def restore_tiles(byte_smem, k_smem, v_smem, stage, infos, head_dim, compressed):
  """Decode each page slot's groups into the tiles of `stage`; zero V of absent slots.

  Block starts come from the slot bytes of word1, as the inline restore finds them.
  """
  nb = head_dim // 32
  for s in range(R.PAGES_PER_STEP):
    flags = infos[s][0]
    rows_of_slot = pl.ds(s * PAGE, PAGE)

    @pl.when(flags == 0)
    def _():
      v_smem[stage, rows_of_slot, :] = jnp.zeros((PAGE, head_dim), jnp.bfloat16)

    if not compressed:
      continue
    for kind, tile in enumerate((k_smem, v_smem)):
      word1 = infos[s][1 + kind]
      exceptions = None
      if len(infos[s]) == R.INFO_WORDS_V2:  # version 2: words 2, 3 of the kind's record
        w2, w3 = infos[s][3 + 2 * kind], infos[s][4 + 2 * kind]
        exceptions = jnp.stack([((w2, w3)[j // 2] >> (16 * (j % 2))) & 0xFFFF for j in range(nb)])

      @pl.when(flags == R.FLAG_PAGE)
      def _():
        flat = byte_smem[stage, kind, s].reshape(-1)
        slot_bytes = jnp.stack([(word1 >> (8 * j)) & 0xFF for j in range(nb)])
        starts = codec.block_offsets_in_group(slot_bytes)  # units from the slot start
        rows = jnp.stack([lax.dynamic_slice(flat, (starts[j] * R.UNIT,), (4 * R.UNIT,)) for j in range(nb)])
        bits = FB.decode_rows(rows, slot_bytes, exceptions)  # [nb, 512] in position order
        tile[stage, rows_of_slot, :] = FB.from_bits(FL.blocks_to_pages(bits, "kv"[kind]))


def gather_pages(page_table_ref, meta_ref, chunk_ref, row_start, row_end, kvh, *, max_pages, num_pages, nblocks,
                 compressed, version=1):
  """`page_prefetch_mgpu.gather_pages` with scalar loads and stores (same chunk contents)."""
  def entry(p, _):
    row = jnp.minimum(row_start + p, row_end - 1)
    phys = jnp.clip(page_table_ref[row // max_pages, row % max_pages], 0, num_pages - 1)
    chunk_ref[p, 0] = phys
    if compressed:
      for kind in range(2):
        word0, word1 = meta_ref[kvh, phys, kind, 0], meta_ref[kvh, phys, kind, 1]
        n_raw = sum(((word1 >> (8 * j)) & 0xFF == R.RAW).astype(jnp.int32) for j in range(nblocks))
        exceptions = [lax.bitcast_convert_type(meta_ref[kvh, phys, kind, w], jnp.int32) for w in (2, 3)[: 2 * (version - 1)]]
        fields = ((word0 & 0x3FFFFFFF).astype(jnp.int32), lax.bitcast_convert_type(word1, jnp.int32), n_raw, *exceptions)
        for f, value in enumerate(fields):
          chunk_ref[p, 1 + P.KIND_WORDS[version] * kind + f] = value
    return ()

  lax.fori_loop(0, P.CHUNK_PAGES, entry, ())
