"""The decoder runtime: layers, rotary tables, KV caches, the forward over a batch of rows."""
