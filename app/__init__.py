"""The HTTP service (OpenAI-compatible API) and the demo. Not built yet: issue #7."""
