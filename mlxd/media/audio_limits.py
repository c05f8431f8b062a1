"""What one audio upload may be, checked before any expensive work.

Every number is a ``ServerConfig`` field with a ``mlxd serve`` flag. The upload
size is counted while the multipart body streams in (``server/multipart.py``),
so a 2 GB upload is refused after 25 MiB, not after buffering it; the sample
rate, channel count and duration are read from the container's header before
decoding and enforced again while decoding (a header can lie). All of it runs
before a model is leased, so a refused upload never loads a model.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlxd.config import ServerConfig
from mlxd.errors import InvalidRequest

MiB = 1024 * 1024


@dataclass(frozen=True)
class AudioLimits:
    """Limits on one uploaded recording."""

    upload_bytes: int = 25 * MiB  # the file as sent (OpenAI's limit is 25 MB)
    seconds: float = 1800.0  # decoded duration (Whisper's mel of it is held at once)
    sample_rate: int = 192_000  # Hz, as stored in the file
    channels: int = 8

    @classmethod
    def from_config(cls, config: ServerConfig) -> AudioLimits:
        """The limits a server runs with (its ``--max-audio-*`` flags)."""
        return cls(upload_bytes=config.max_audio_upload_bytes,
                   seconds=config.max_audio_seconds,
                   sample_rate=config.max_audio_sample_rate,
                   channels=config.max_audio_channels)

    def check_format(self, sample_rate: int, channels: int) -> None:
        """400 for a sample rate or channel count over the limits (from the header)."""
        if sample_rate <= 0 or sample_rate > self.sample_rate:
            raise InvalidRequest(
                f"The audio's sample rate is {sample_rate} Hz; this server accepts 1 to "
                f"{self.sample_rate} Hz (--max-audio-sample-rate).", param="file",
                code="audio_sample_rate")
        if channels <= 0 or channels > self.channels:
            raise InvalidRequest(
                f"The audio has {channels} channels; this server accepts 1 to "
                f"{self.channels} (--max-audio-channels).", param="file",
                code="audio_channels")

    def check_seconds(self, seconds: float) -> None:
        """400 when the recording is longer than ``seconds``."""
        if seconds > self.seconds:
            raise InvalidRequest(
                f"The audio is longer than this server's limit of {self.seconds:g} seconds "
                "(--max-audio-seconds). Split the recording.", param="file",
                code="audio_too_long")
