"""Checkpoint file formats: the safetensors header parser and writer, and the Hugging Face directory layout."""
