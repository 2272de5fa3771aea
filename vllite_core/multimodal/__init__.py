"""Multimodal inputs (images) for decoder models: what a prompt's media become on the request.

A model that declares ``SupportsMultiModalDecoder`` expands each image's placeholder token into as many tokens
as its encoder produces embeddings, and records one ``features.MultiModalFeature`` per image on the request:
where its placeholders sit in the prompt, how many there are, the content hash that keys the encoder cache
and the block hashes, and the processed pixels (opaque to the core). Modules: ``config`` (engine settings),
``features``, ``images`` (checks, decoding, hashing), ``media`` (URLs), ``chat`` (image parts),
``encoder_cache`` (the scheduler's side), ``runner`` (the runner's side).
"""
