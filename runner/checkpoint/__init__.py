"""Checkpoints as every sampler and the trainer exchange them: the Hugging Face layout (config.json,
safetensors, key names and shapes; hf_checkpoint.py), the shipped byte tokenizer (tokenizer.py) and
seeded tiny checkpoints (init_model.py). Imports no other room of the runner.
"""
