"""Paged KV caches over the 12-bit format and decode attention on them."""
