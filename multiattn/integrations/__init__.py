"""Bridges from other libraries' attention hooks to multiattn.

Each submodule imports its library on first use, never at ``import multiattn``:
``multiattn.integrations.transformers`` (Hugging Face transformers, docs/huggingface.md).
"""
