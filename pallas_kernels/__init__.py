"""Pallas GPU kernels of ZipFusion-JAX; each module pairs a kernel with its jnp reference."""
