"""mlx-audio behind one seam: mlxd uses its public loaders and ``generate`` only, so
``PRIVATE`` is empty; the versions are declared so an upgrade is a deliberate step.
Kokoro's convolution fix is a reversible patch with its own self-check
(``engines/audio/patches/kokoro_conv.py``)."""

from __future__ import annotations

from mlxd.engines.upstream.versions import Adapter, Private

PRIVATE: tuple[Private, ...] = ()

ADAPTER = Adapter("mlx-audio", ("0.6.2",), PRIVATE)
