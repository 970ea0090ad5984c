"""Checkpoint conversion: Hugging Face safetensors and GGUF to and from linjax models."""
