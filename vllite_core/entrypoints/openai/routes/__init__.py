"""The server's routes, one module-level router per group; ``api_server.build_app`` includes them.

generate (completions, chat, responses), tokenize (/tokenize, /detokenize), models (/v1/models),
admin (health, version, metrics). Elsewhere: serving_pooling (embeddings, pooling, classify, score,
rerank), serving_transcription (audio), serving_lora (runtime adapter loads), anthropic.serving
(/v1/messages). Every route reads its state from ``request.app.state`` and raises its errors:
error_handlers translates them, once, for all."""
