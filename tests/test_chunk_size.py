"""The store's chunk size: stranded room against granularity (`generate.chunk_pages_for`), and what
it buys in e2e's admission (host simulation, `benchmarks.capacity.admitted_sequences`)."""

from __future__ import annotations

import pytest

from benchmarks.capacity import admitted_sequences
from models.configs import get_config
from zipfusion_jax.generate import MAX_CHUNK_PAGES, MIN_CHUNK_PAGES, chunk_pages_for, serving_config


@pytest.mark.parametrize("pages,want", [(0, 16), (16 * 32 - 1, 16), (32 * 32, 32), (64 * 32 - 1, 32), (64 * 32, 64), (10**7, 64)])
def test_chunk_pages_keep_32_chunks_a_layer_within_16_to_64(pages, want):
  assert chunk_pages_for(pages) == want
  assert MIN_CHUNK_PAGES <= want <= MAX_CHUNK_PAGES


def test_bf16_stores_keep_the_finest_chunks():
  assert chunk_pages_for(10**7, compressed=False) == MIN_CHUNK_PAGES


def test_serving_config_sizes_chunks_from_the_budget_or_the_slots():
  llama = get_config("llama3.1-8b")
  assert serving_config(llama, [8192], 256, 64, True, kv_memory_mib=48 * 1024).chunk_pages == 64
  assert serving_config(llama, [8192], 256, 64, False, kv_memory_mib=48 * 1024).chunk_pages == 16
  assert serving_config(llama, [100], 20, 1, True).chunk_pages == 16  # 8 pages: as fine as allowed
  assert serving_config(llama, [100], 20, 1, True, chunk_pages=4).chunk_pages == 4  # explicit wins


def test_larger_chunks_admit_more_sequences_into_the_same_12_bit_budget():
  """Llama-3.1-8B, 8K, 48 GiB, 95% of blocks eligible (e2e's setting): 16-page chunks strand ~2.2
  GiB (a raw page's room less a compressed page, per chunk) and admit 57 sequences, as the H100
  e2e runs of 2026-12-05 did; the automatic size admits 59. The BF16 store admits 46 either way."""
  fine = admitted_sequences("llama3.1-8b", "zipfusion", 8192, chunk_pages=16)
  auto = admitted_sequences("llama3.1-8b", "zipfusion", 8192)
  bf16 = admitted_sequences("llama3.1-8b", "uncompressed", 8192)
  assert (fine["admitted"], auto["admitted"], bf16["admitted"]) == (57, 59, 46)
  assert auto["stranded_gib"] < 0.3 * fine["stranded_gib"]
