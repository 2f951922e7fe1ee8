"""`specdecode serve`: an OpenAI-compatible HTTP server over the speculative engine."""
