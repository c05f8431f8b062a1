"""Speech: transcription (mlx-whisper, mlx-audio) and synthesis (mlx-audio, Piper), with the
reversible patches of mlx-audio."""
