"""Hugging Face transformers' layouts, both ways: which layout holds a shape and its config.json (layouts), the
tensors of a mixture of experts (moe) and of DeepSeek's multi-head latent attention (deepseek), and the files
(files: config.json, safetensors, the tokenizer's)."""
