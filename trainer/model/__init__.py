"""Models: the built-in Llama, Hugging Face models and files, the base-model stage, export, generation."""
