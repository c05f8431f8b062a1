"""Text front end for speech: sentence splitting and espeak-ng phonemes.

Phonemes come from Debian's ``espeak-ng`` program run as a subprocess (text on
stdin, IPA on stdout), so no GPL code is linked into the server, and nothing
here ever reaches the network. espeak-ng prints one line per clause and drops
the punctuation; Piper and Kokoro voices were trained on phonemes that keep it
(pauses and intonation), so a sentence's clauses are joined with ", " and its
own final mark is put back.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import unicodedata
from dataclasses import dataclass

ESPEAK_PACKAGE = "espeak-ng"
INSTALL_HINT = ("install Debian/Ubuntu's 'espeak-ng' package (sudo apt-get install espeak-ng; "
                "Fedora: dnf install espeak-ng; macOS: brew install espeak-ng)")
# A sentence ends at . ! ? … (with closing quotes/brackets) followed by space,
# or at a line break; "Dr. Smith" splits too, which only costs a short pause.
_SENTENCE_END = re.compile(r"[.!?…][\"'”’)\]]*(?=\s)|\n")
_CLAUSE_BREAK = re.compile(r"(?<=[,;:])\s+")
# Control characters: espeak-ng stops reading at NUL, and none of them is speech.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")
_FINAL_MARKS = ".!?"
# Titles whose period ends no sentence ("Dr. Smith").
_ABBREVIATIONS = {"mr.", "mrs.", "ms.", "dr.", "st.", "prof.", "sr.", "jr.", "vs.", "e.g.",
                  "i.e.", "etc.", "no.", "mt."}


class EspeakMissing(RuntimeError):
    """espeak-ng is not installed (the message names the package)."""


class EspeakFailed(RuntimeError):
    """espeak-ng refused the text or the voice."""


@dataclass(frozen=True)
class Espeak:
    """One espeak-ng program and the voice (language) it phonemizes with."""

    program: str
    voice: str
    timeout_s: float = 30.0

    def phonemize(self, sentence: str) -> str:
        """IPA for one sentence; clauses joined with ", ", the final mark kept."""
        text = clean_text(sentence)
        if not text:
            return ""
        try:
            proc = subprocess.run([self.program, "-q", "--ipa", "-v", self.voice],
                                  input=text.encode("utf-8"), capture_output=True,
                                  timeout=self.timeout_s, check=False)
        except subprocess.TimeoutExpired as e:
            raise EspeakFailed(f"espeak-ng took over {self.timeout_s:.0f} s") from e
        if proc.returncode != 0:
            err = proc.stderr.decode("utf-8", "replace").strip() or f"exit {proc.returncode}"
            raise EspeakFailed(f"espeak-ng (voice {self.voice!r}): {err}")
        clauses = [line.strip() for line in proc.stdout.decode("utf-8", "replace").splitlines()]
        ipa = ", ".join(c for c in clauses if c)
        if not ipa:
            return ""
        last = text.rstrip("\"'”’)] ")[-1:]
        return ipa + (last if last in _FINAL_MARKS else ".")


def find_espeak() -> str:
    """The espeak-ng program's path, or ``EspeakMissing`` naming the package."""
    program = shutil.which("espeak-ng")
    if program is None:
        raise EspeakMissing(f"this voice needs the {ESPEAK_PACKAGE} program for its phonemes, "
                            f"and it is not on PATH: {INSTALL_HINT}.")
    return program


def check_voice(espeak: Espeak) -> None:
    """Fail now (``EspeakFailed``) if espeak-ng does not know ``espeak.voice``."""
    if not espeak.phonemize("a."):
        raise EspeakFailed(f"espeak-ng gives no phonemes for voice {espeak.voice!r}")


def clean_text(text: str) -> str:
    """NFC, control characters dropped, whitespace collapsed."""
    text = _CONTROL.sub(" ", unicodedata.normalize("NFC", text))
    return " ".join(text.split())


def split_sentences(text: str, max_chars: int = 300) -> list[str]:
    """Sentences in order, each at most ``max_chars`` (long ones cut at clause breaks,
    then at spaces), so the first audio comes quickly and no model overflows."""
    sentences: list[str] = []
    for sentence in _sentences(text):
        sentence = clean_text(sentence)
        if sentence and sentences and _ends_in_title(sentences[-1]):
            sentences[-1] += " " + sentence
        elif sentence:
            sentences.append(sentence)
    return [piece for sentence in sentences for piece in _cut(sentence, max_chars)]


def _sentences(text: str) -> list[str]:
    """Cut after each sentence end (its closing quotes and brackets kept) and line break."""
    out, start = [], 0
    for m in _SENTENCE_END.finditer(text):
        out.append(text[start:m.end()])
        start = m.end()
    out.append(text[start:])
    return out


def _ends_in_title(sentence: str) -> bool:
    return sentence.rsplit(" ", 1)[-1].lower() in _ABBREVIATIONS


def _cut(sentence: str, max_chars: int) -> list[str]:
    if len(sentence) <= max_chars:
        return [sentence]
    pieces: list[str] = []
    for clause in _CLAUSE_BREAK.split(sentence):
        if pieces and len(pieces[-1]) + 1 + len(clause) <= max_chars:
            pieces[-1] += " " + clause
        else:
            pieces.extend(_cut_words(clause, max_chars))
    return pieces


def _cut_words(text: str, max_chars: int) -> list[str]:
    pieces: list[str] = []
    current = ""
    for word in text.split(" "):
        while len(word) > max_chars:  # one endless "word": cut it anyway
            if current:
                pieces.append(current)
                current = ""
            pieces.append(word[:max_chars])
            word = word[max_chars:]
        if current and len(current) + 1 + len(word) > max_chars:
            pieces.append(current)
            current = word
        else:
            current = f"{current} {word}" if current else word
    if current:
        pieces.append(current)
    return pieces
