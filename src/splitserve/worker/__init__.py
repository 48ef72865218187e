"""One engine behind an OpenAI-compatible HTTP server (``splitserve worker``)."""
