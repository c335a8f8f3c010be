"""The compressor benchmark's per-variant check (`benchmarks.compress.check_exact`): it passes an
unordered, untailed persistent variant's whole output, and it fails on any byte that differs."""

import jax
import jax.numpy as jnp
import pytest

import zipfusion_jax as zf
from benchmarks.compress import check_exact
from benchmarks.synthetic_kv import synthetic_blocks
from pallas_kernels.compress import CompressConfig, compress_pallas

CONFIG = CompressConfig(single_pass=True, ordered=False, tile_groups=1, num_warps=1, persistent_programs=3,
                        offset_ahead=True, zero_tail=False)


@pytest.fixture(scope="module")
def blocks_and_output():
  x = synthetic_blocks(jax.random.key(0), 48)
  return x, compress_pallas(x, config=CONFIG, interpret=True)


def test_check_passes_the_kernel_s_output(blocks_and_output):
  x, c = blocks_and_output
  check_exact(x, c, zf.compress(x), CONFIG)


def test_check_fails_when_one_value_differs(blocks_and_output):
  x, c = blocks_and_output
  other = x.at[5, 7].set(jnp.bfloat16(1e30))  # one block turns raw: the reference's bytes change
  with pytest.raises(AssertionError, match="differ"):
    check_exact(x, c, zf.compress(other), CONFIG)
