"""Serving our engine over HTTP: the OpenAI-compatible API (`http`), the server that owns the
queue and the engine thread (`server`, `worker`, `backend`, `fairqueue`), the request protocol
and streaming text (`protocol`, `textstream`), and /metrics (`metrics`)."""
