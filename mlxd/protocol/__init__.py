"""Pydantic models of each API's wire format. No logic lives here."""
