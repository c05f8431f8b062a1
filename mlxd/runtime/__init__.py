"""Neutral runtime pieces that both ``models/`` and ``engines/`` use (the model worker thread)."""
