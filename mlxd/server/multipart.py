"""A ``multipart/form-data`` body read as it streams in, with the upload limit enforced live.

Starlette's ``request.form()`` spools the whole body (to disk past 1 MiB)
before a handler sees it, so a 2 GB upload would be written out before any
limit could refuse it. Here python-multipart's push parser is fed chunk by
chunk from ``request.stream()``: the file part's bytes are counted as they
arrive and the request is refused (413) as soon as they pass the limit, having
read at most one network chunk beyond it. Text fields have their own small
bound; the parts' count is bounded too.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header

from mlxd.errors import InvalidRequest, MlxdError, PayloadTooLarge

MAX_FIELD_BYTES = 64 * 1024  # one text field (a prompt is at most a few hundred tokens)
MAX_PARTS = 64
# the most a form adds to its file: every other part at its limit, plus part headers
MAX_FORM_OVERHEAD_BYTES = MAX_PARTS * (MAX_FIELD_BYTES + 1024)


@dataclass
class UploadedFile:
    filename: str | None
    content_type: str | None
    data: bytes


@dataclass
class MultipartForm:
    """Text fields (each name may repeat, e.g. ``timestamp_granularities[]``) and one file."""

    fields: dict[str, list[str]] = field(default_factory=dict)
    file: UploadedFile | None = None


def boundary_of(content_type: str | None) -> bytes:
    """The boundary of a ``multipart/form-data`` content type, or a 400."""
    kind, params = parse_options_header(content_type or "")
    boundary = params.get(b"boundary")
    if kind != b"multipart/form-data" or not boundary:
        raise InvalidRequest("This endpoint takes a multipart/form-data body (a 'file' part "
                             "and text fields), not "
                             f"'{content_type or 'no Content-Type'}'.", code="invalid_body")
    return boundary


class _Collector:
    """python-multipart callbacks that build a ``MultipartForm`` and enforce the limits."""

    def __init__(self, file_field: str, max_file_bytes: int) -> None:
        self.file_field = file_field
        self.max_file_bytes = max_file_bytes
        self.form = MultipartForm()
        self.error: MlxdError | None = None
        self.parts = 0
        self.finished = False
        self._header_name = b""
        self._header_value = b""
        self._headers: dict[bytes, bytes] = {}
        self._name: str | None = None
        self._filename: str | None = None
        self._buf = bytearray()

    def callbacks(self) -> dict[str, object]:
        return {"on_part_begin": self._begin, "on_header_field": self._header_field,
                "on_header_value": self._header_val, "on_header_end": self._header_end,
                "on_headers_finished": self._headers_done, "on_part_data": self._data,
                "on_part_end": self._end, "on_end": self._done}

    def _fail(self, error: MlxdError) -> None:
        if self.error is None:
            self.error = error

    def _begin(self) -> None:
        self.parts += 1
        if self.parts > MAX_PARTS:
            self._fail(InvalidRequest(f"The form has more than {MAX_PARTS} parts."))
        self._headers, self._buf = {}, bytearray()
        self._header_name = self._header_value = b""

    def _header_field(self, data: bytes, start: int, end: int) -> None:
        self._header_name += data[start:end]

    def _header_val(self, data: bytes, start: int, end: int) -> None:
        self._header_value += data[start:end]

    def _header_end(self) -> None:
        self._headers[self._header_name.lower()] = self._header_value
        self._header_name = self._header_value = b""

    def _headers_done(self) -> None:
        _, params = parse_options_header(self._headers.get(b"content-disposition", b""))
        name, filename = params.get(b"name"), params.get(b"filename")
        self._name = name.decode("utf-8", "replace") if name is not None else None
        self._filename = filename.decode("utf-8", "replace") if filename is not None else None
        if self._name is None:
            self._fail(InvalidRequest("A form part has no name (Content-Disposition)."))
        elif self._name == self.file_field and self.form.file is not None:
            self._fail(InvalidRequest(f"The form has more than one '{self.file_field}' part.",
                                      param=self.file_field))

    def _data(self, data: bytes, start: int, end: int) -> None:
        if self.error is not None:
            return
        self._buf += data[start:end]
        if self._name == self.file_field:
            if len(self._buf) > self.max_file_bytes:
                self._fail(_too_large(self.max_file_bytes))
        elif len(self._buf) > MAX_FIELD_BYTES:
            self._fail(InvalidRequest(f"Form field '{self._name}' is longer than "
                                      f"{MAX_FIELD_BYTES} bytes.", param=self._name))

    def _end(self) -> None:
        if self.error is not None or self._name is None:
            return
        if self._name == self.file_field:
            ctype = self._headers.get(b"content-type")
            self.form.file = UploadedFile(self._filename,
                                          ctype.decode("latin-1") if ctype else None,
                                          bytes(self._buf))
        else:
            try:
                value = self._buf.decode("utf-8")
            except UnicodeDecodeError:
                self._fail(InvalidRequest(f"Form field '{self._name}' is not UTF-8 text.",
                                          param=self._name))
                return
            self.form.fields.setdefault(self._name, []).append(value)
        self._buf = bytearray()

    def _done(self) -> None:
        self.finished = True


def _too_large(limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(f"The uploaded file is larger than this server's limit of {limit} "
                           "bytes (--max-audio-upload-bytes). Split the recording or compress "
                           "it (mp3, opus).", param="file", code="audio_too_large")


async def read_multipart(content_type: str | None, content_length: str | None,
                         chunks: AsyncIterator[bytes], *, file_field: str,
                         max_file_bytes: int) -> MultipartForm:
    """Parse the body from ``chunks``, refusing it as soon as a limit is passed.

    A declared ``Content-Length`` that cannot fit (the file limit plus room for the
    text fields) is refused before a byte of the body is read.
    """
    boundary = boundary_of(content_type)
    room = max_file_bytes + MAX_PARTS * 1024 + 4 * MAX_FIELD_BYTES
    if content_length and content_length.isdigit() and int(content_length) > room:
        raise _too_large(max_file_bytes)
    collector = _Collector(file_field, max_file_bytes)
    parser = MultipartParser(boundary, collector.callbacks())  # type: ignore[arg-type]
    async for chunk in chunks:
        try:
            parser.write(chunk)
        except MultipartParseError as e:
            raise InvalidRequest(f"The multipart body is malformed: {e}.",
                                 code="invalid_body") from None
        if collector.error is not None:
            raise collector.error
    if collector.error is not None:
        raise collector.error
    if not collector.finished:
        raise InvalidRequest("The multipart body ended before its closing boundary.",
                             code="invalid_body")
    return collector.form
