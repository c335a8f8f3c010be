"""Checkpoint loaders: GGUF (the embedded SmolLM2 model), Hugging Face safetensors, tokenizers."""
