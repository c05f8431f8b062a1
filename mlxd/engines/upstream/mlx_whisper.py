"""mlx-whisper's internals, behind one seam (declared; ``engines/audio/stt_whisper.py``
still does the rebinding itself).

mlxd runs ``mlx_whisper.transcribe.transcribe`` on a copy of its globals: its model
comes from the loaded engine instead of the module's process-wide ``ModelHolder``,
and its ``print`` (with ``verbose=True``, one line per decoded segment) goes to the
engine, which streams the segments. ``PRIVATE`` lists what that relies on;
``tests/test_upstream_adapters.py`` checks it on the installed version.
"""

from __future__ import annotations

from mlxd.engines.upstream.versions import Adapter, Private

_USED_BY = "engines/audio/stt_whisper.py: bind_transcribe"

PRIVATE = (
    Private("mlx_whisper.transcribe", "transcribe", "ModelHolder", "global", _USED_BY),
    Private("mlx_whisper.transcribe", "transcribe", "print", "global", _USED_BY),
    Private("mlx_whisper.transcribe", "ModelHolder", "get_model", "method", _USED_BY,
            ("model_path", "dtype")),
)

ADAPTER = Adapter("mlx-whisper", ("0.4.3",), PRIVATE)
