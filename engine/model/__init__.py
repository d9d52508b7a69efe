"""The model: its geometry (spec), checkpoints and their loading, the forward pass, the KV
cache, the tokenizer, and the synthetic checkpoints the tests and the demo use.
"""
