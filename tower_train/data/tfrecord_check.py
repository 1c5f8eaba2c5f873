"""Whether TFRecord files are whole, checked without TensorFlow's TFRecord reader: each record's length
against its CRC-32C, the file's end against its last record's, and a compressed file's first bytes
against its compression. TensorFlow reads a file cut inside a record's header as a shorter file,
without a word; `TFRecordSource` checks its files here before it reads them, and again to name
the file a read failed in.
"""

from __future__ import annotations

import struct
from typing import Sequence, Union

import tensorflow as tf

from tower_train.data.source import DataError
from tower_train.errors import op_error_text

Files = Union[str, Sequence[str]]  # paths or glob patterns; a string is one pattern
COMPRESSIONS = (None, "", "ZLIB", "GZIP")
# A record is [uint64 length][uint32 masked crc32c of the length][data][uint32 masked crc32c of the data].
_HEADER, _FOOTER = 12, 4
_GZIP_MAGIC = b"\x1f\x8b"
_WALK_CHUNK = 1 << 16  # bytes read at once while walking a file's headers
# Bytes of records that one parallel read takes at once (`tfrecord_read`): large enough that a read's
# own cost is small beside its records', small enough that the reads in flight hold little memory.
CHUNK_BYTES = 1 << 20
Chunk = tuple[int, int]  # (the byte offset of its first record, its number of records)


def checked_files(name: str, what: str, patterns: Files, compression: str | None) -> list[str]:
    """Patterns -> files: in the patterns' order, each one's matches sorted, duplicates dropped.

    Raises DataError naming the first pattern that matches no file, or the first file that is
    not a whole TFRecord file of `compression` (`file_fault`)."""
    return list(checked_chunks(name, what, patterns, compression))


def checked_chunks(name: str, what: str, patterns: Files,
                   compression: str | None) -> dict[str, list[Chunk] | None]:
    """`checked_files`'s files, each with its records in chunks of about CHUNK_BYTES, found by
    the same walk (None for a compressed file, whose records cannot be reached without
    decompressing all before them)."""
    if isinstance(patterns, (str, bytes)):
        patterns = [patterns]
    patterns = list(patterns)
    if not patterns:
        raise DataError(f"{name}: {what} is empty: give at least one file or glob pattern")
    files: dict[str, list[Chunk] | None] = {}
    for pattern in patterns:
        if not isinstance(pattern, str) or not pattern:
            raise DataError(f"{name}: {what}: {pattern!r} is not a file name or glob pattern")
        try:
            matches = [path for path in sorted(tf.io.gfile.glob(pattern)) if not tf.io.gfile.isdir(path)]
        except tf.errors.OpError as e:
            raise DataError(f"{name}: {what}: cannot list {pattern!r}: {op_error_text(e)}") from e
        if not matches:
            raise DataError(f"{name}: {what}: {pattern!r} matches no file")
        for path in matches:
            if path not in files:
                fault, chunks = walk(path, compression)
                if fault:
                    raise DataError(f"{name}: {what}: {path!r} (matched by {pattern!r}) {fault}")
                files[path] = chunks
    return files


def file_fault(path: str, compression: str | None, suspect: int | None = None) -> str | None:
    """What keeps `path` from being read as a whole TFRecord file of `compression`, as the end of
    a sentence naming it; None if nothing does (`walk`)."""
    return walk(path, compression, suspect)[0]


def walk(path: str, compression: str | None,
         suspect: int | None = None) -> tuple[str | None, list[Chunk] | None]:
    """(fault, chunks): what keeps `path` from being read as a whole TFRecord file of
    `compression`, as the end of a sentence naming it, None if nothing does; and the records of a
    whole uncompressed file in chunks of about CHUNK_BYTES, each starting where a record does
    (None for a compressed file).

    Opening and reading is the readability test (os.access says yes to root). An uncompressed
    file's records are walked header by header, seeking past their data: each length must pass
    its checksum, and the file must end where a record does (TensorFlow reads a file cut inside
    a record's header as a shorter file, without a word). The file is read a chunk at a time,
    so records smaller than a chunk are all read; larger ones are seeked past. The record that holds the offset
    `suspect` (one TensorFlow's error named) has its data's checksum checked too. A compressed
    file cannot be walked without decompressing all of it, so only its first bytes are checked.
    """
    compression_type = repr(compression or "")
    try:
        with tf.io.gfile.GFile(path, "rb") as f:
            size = f.size()
            head = f.read(_HEADER)
            tfrecord = _length_checks(head)
            if compression and not head:
                return None, None  # no record: TensorFlow reads no record from it either
            if compression == "GZIP" and head[:2] != _GZIP_MAGIC:
                return ("is not GZIP-compressed (it does not start with gzip's bytes 1f 8b), but "
                        f"compression_type is {compression_type}"
                        + ("; it reads as an uncompressed TFRecord file: give compression=None"
                           if tfrecord else "")), None
            if compression == "ZLIB" and not _zlib_header(head):
                return (f"is not ZLIB-compressed (it does not start with a zlib header), but "
                        f"compression_type is {compression_type}"
                        + ("; it reads as an uncompressed TFRecord file: give compression=None"
                           if tfrecord else "")), None
            if compression:
                return None, None
            if head and not tfrecord:
                return _what_it_is(head, compression_type), None
            offset = start = 0
            chunks: list[Chunk] = []
            chunk = b""  # the file's bytes from `start` on: a read per chunk, not per record
            while offset < size:
                if offset + _HEADER > start + len(chunk):
                    f.seek(offset)
                    start, chunk = offset, f.read(_WALK_CHUNK)
                header = chunk[offset - start:offset - start + _HEADER]
                if len(header) < _HEADER:
                    return (f"ends inside the header of the record at offset {offset} ({len(header)} "
                            f"of its {_HEADER} bytes): the file is truncated"), None
                if not _length_checks(header):
                    return f"has a corrupted record at offset {offset}: its length fails its checksum", None
                end = offset + _HEADER + struct.unpack("<Q", header[:8])[0] + _FOOTER
                if end > size:
                    return (f"ends inside the record at offset {offset} (the record would end at byte "
                            f"{end}, the file ends at byte {size}): the file is truncated"), None
                if suspect is not None and offset <= suspect < end and _data_fault(f, offset, end):
                    return f"has a corrupted record at offset {offset}: its data fails its checksum", None
                if not chunks or offset - chunks[-1][0] >= CHUNK_BYTES:
                    chunks.append((offset, 0))
                chunks[-1] = (chunks[-1][0], chunks[-1][1] + 1)
                offset = end
    except (tf.errors.OpError, OSError) as e:
        return f"cannot be read: {op_error_text(e)}", None
    return None, chunks


def _what_it_is(head: bytes, compression_type: str) -> str:
    """Says what a file is whose first record's length fails its checksum."""
    if head[:2] == _GZIP_MAGIC:
        return (f"is GZIP-compressed (it starts with gzip's bytes 1f 8b), but compression_type is "
                f"{compression_type}: give compression='GZIP'")
    if _zlib_header(head):
        return (f"looks ZLIB-compressed (it starts with a zlib header), but compression_type is "
                f"{compression_type}: give compression='ZLIB'")
    return (f"is not a TFRecord file (its first record's length fails its checksum; compression_type "
            f"is {compression_type}, and it is neither GZIP- nor ZLIB-compressed)")


def _length_checks(header: bytes) -> bool:
    """Whether a record's 12-byte header is whole and its length passes its checksum."""
    return len(header) == _HEADER and masked_crc32c(header[:8]) == struct.unpack("<I", header[8:])[0]


def _data_fault(f, offset: int, end: int) -> bool:
    """Whether the data of the record [offset, end) fails its checksum."""
    f.seek(offset + _HEADER)
    data = f.read(end - offset - _HEADER - _FOOTER)
    return masked_crc32c(data) != struct.unpack("<I", f.read(_FOOTER))[0]


def _zlib_header(head: bytes) -> bool:
    """Whether `head` starts with a zlib stream's header (RFC 1950: deflate, and its check)."""
    return len(head) >= 2 and head[0] & 0x0F == 8 and (head[0] << 8 | head[1]) % 31 == 0


def _crc32c_table() -> tuple[int, ...]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
        table.append(crc)
    return tuple(table)


_CRC32C_TABLE = _crc32c_table()


def masked_crc32c(data: bytes) -> int:
    """TFRecord's checksum: CRC-32C (Castagnoli), rotated right by 15 bits plus a constant."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _CRC32C_TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    crc ^= 0xFFFFFFFF
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF

