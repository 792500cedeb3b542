"""Serving wiring for `livedraft serve` and `up`: our engine behind the HTTP server with hot-swap from
the registry (`engine`), or a supervised llama-server fed the registry's heads as GGUF (`llama`)."""
