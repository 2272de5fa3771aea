"""The OpenAI-compatible HTTP server (`vllite serve`): FastAPI routes over AsyncLLM."""
