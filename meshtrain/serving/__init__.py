"""``meshtrain serve``: an OpenAI-compatible HTTP server with continuous batching over a slotted KV cache.

``slots`` (the cache and its two compiled programs) <- ``scheduler`` (the thread that owns them) <-
``protocol`` (OpenAI's request fields, checked) <- ``app`` (the Starlette routes) <- ``build`` (restore,
warm up, wire together; what ``meshtrain.commands.serve`` runs under Uvicorn).
"""
