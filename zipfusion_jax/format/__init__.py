"""The 12-bit block format: block rule, page layout, reference codec, validation."""
