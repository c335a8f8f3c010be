"""Serving: device KV state, chunk allocator, KV backend, scheduler and engine (issue 5)."""
