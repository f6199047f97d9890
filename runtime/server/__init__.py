"""The OpenAI-compatible HTTP server (``compress serve``): app, wire protocol, metrics, admission."""
