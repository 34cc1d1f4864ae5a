"""The HTTP service: an OpenAI-compatible REST API over the vlmspec engine (app.server)."""
