"""Model side of vllite: architecture registry, model sources (HF folders, GGUF), loaders, built-in models.

Import submodules directly (``model_registry.registry``, ``.source``, ``.loader``); this package
imports nothing so that listing plugins stays cheap.
"""
