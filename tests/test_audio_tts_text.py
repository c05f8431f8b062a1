"""The speech text front end: sentence splitting and the espeak-ng subprocess."""

from __future__ import annotations

import shutil

import pytest

from mlxd.media.phonemes import Espeak, EspeakFailed, EspeakMissing, find_espeak, split_sentences


def test_sentences_split_at_their_ends_not_at_titles() -> None:
    text = 'Hello Mr. Smith. How are you?\n\nFine, thanks! "Quoted." (Aside.) e.g. this'
    assert split_sentences(text) == ["Hello Mr. Smith.", "How are you?", "Fine, thanks!",
                                     '"Quoted."', "(Aside.)", "e.g. this"]


@pytest.mark.parametrize("text", ["word " * 500, "x" * 1000, "a, " * 400, "\x00\x07 \u200b"])
def test_every_piece_fits_the_limit_and_no_text_is_lost(text: str) -> None:
    pieces = split_sentences(text, max_chars=50)
    assert all(0 < len(p) <= 50 for p in pieces)
    assert "".join(pieces).replace(" ", "") == "".join(
        text.replace("\x00", "").replace("\x07", "").split())


def test_a_missing_program_names_the_package(monkeypatch: pytest.MonkeyPatch,
                                             tmp_path: object) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(EspeakMissing, match="apt-get install espeak-ng"):
        find_espeak()


needs_espeak = pytest.mark.skipif(shutil.which("espeak-ng") is None,
                                  reason="espeak-ng is not installed (make setup installs it)")


@needs_espeak
def test_text_that_looks_like_options_is_spoken_not_obeyed() -> None:
    espeak = Espeak(find_espeak(), "en-us")
    # On stdin, "--help -v xx" is text: espeak-ng neither prints its help nor fails.
    ipa = espeak.phonemize("--help -v xx --stdout")
    assert ipa and "espeak" not in ipa.lower() and ipa.endswith(".")
    assert espeak.phonemize("Really?").endswith("?")
    assert espeak.phonemize("\x00\x01") == ""


@needs_espeak
def test_an_unknown_espeak_voice_fails_clearly() -> None:
    with pytest.raises(EspeakFailed, match="nosuchvoice"):
        Espeak(find_espeak(), "nosuchvoice").phonemize("Hello.")
