"""HPACK (RFC 7541) for the proxy's h2 connections: the encoder and decoder h2 uses, rebuilt for
the relay's hot path.

`hpack` spends ~2 µs per header even on a one-byte indexed field (per-field memoryview slices,
logging calls, linear table searches); a relayed request costs six header blocks. These keep the
same interface and errors (h2 swaps them in for `hpack.Encoder` / `hpack.Decoder`) with:
prebuilt static entries, dict-indexed dynamic tables, single-byte fast paths, and literals sent
without Huffman coding (a few more bytes on the wire for values seen once; repeated values are
indexed anyway). Huffman-coded input is decoded with `hpack`'s table. Fields marked never-indexed
(`NeverIndexedHeaderTuple`) stay out of the table and keep that mark through the proxy.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Final

from hpack import HeaderTuple, NeverIndexedHeaderTuple
from hpack.exceptions import (
    HPACKDecodingError,
    InvalidTableIndexError,
    InvalidTableSizeError,
    OversizedHeaderListError,
)
from hpack.huffman_table import decode_huffman
from hpack.table import HeaderTable

DEFAULT_TABLE_SIZE: Final = 4096
DEFAULT_MAX_HEADER_LIST_SIZE: Final = 1 << 16
MAX_ENCODER_TABLE_SIZE: Final = DEFAULT_TABLE_SIZE
ENTRY_OVERHEAD: Final = 32  # RFC 7541 §4.1
_STATIC: Final[tuple[HeaderTuple, ...]] = tuple(
    HeaderTuple(n, v) for n, v in HeaderTable.STATIC_TABLE
)
_STATIC_LEN: Final = len(_STATIC)
_STATIC_FIELDS: Final[dict[tuple[bytes, bytes], int]] = {}
_STATIC_NAMES: Final[dict[bytes, int]] = {}
for _i, (_name, _value) in enumerate(HeaderTable.STATIC_TABLE, start=1):
    _STATIC_FIELDS.setdefault((_name, _value), _i)
    _STATIC_NAMES.setdefault(_name, _i)
_MAX_INT_SHIFT: Final = 28  # integers past 2**28 are refused (no legitimate use)
_HUFFMAN_MAX_BITS: Final = 30  # the longest Huffman code: n coded bytes hold >= 8n/30 octets
# Huffman-coded strings decoded lately: peers that do not index (nginx sends every response
# header as a literal) repeat the same few, and hpack's decoder walks them bit by bit. Bounded:
# short strings only, and forgotten all at once when full.
_HUFFMAN_CACHE: Final[dict[bytes, bytes]] = {}
_HUFFMAN_CACHE_ENTRIES: Final = 1024
_HUFFMAN_CACHE_LENGTH: Final = 64
# Whole header blocks decoded lately, per connection: a peer that indexes sends the same bytes
# for the same headers (a client's requests, a proxy's), and a block that adds nothing to the
# dynamic table decodes to the same list while the table is unchanged. Bounded like the above.
_BLOCK_CACHE_ENTRIES: Final = 64
_BLOCK_CACHE_LENGTH: Final = 512


def _huffman(coded: bytes) -> bytes:
    cached = _HUFFMAN_CACHE.get(coded)
    if cached is not None:
        return cached
    decoded: bytes = decode_huffman(coded)
    if len(coded) <= _HUFFMAN_CACHE_LENGTH:
        if len(_HUFFMAN_CACHE) >= _HUFFMAN_CACHE_ENTRIES:
            _HUFFMAN_CACHE.clear()
        _HUFFMAN_CACHE[coded] = decoded
    return decoded


def _integer(data: bytes, pos: int, value: int) -> tuple[int, int]:
    """Continues an integer whose prefix was all ones (`value`), from `pos`."""
    shift = 0
    end = len(data)
    while True:
        if pos >= end:
            raise HPACKDecodingError("truncated integer")
        byte = data[pos]
        pos += 1
        value += (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
        if shift > _MAX_INT_SHIFT:
            raise HPACKDecodingError("integer too long")


def _put_integer(out: bytearray, value: int, mask: int, flags: int) -> None:
    if value < mask:
        out.append(flags | value)
        return
    out.append(flags | mask)
    value -= mask
    while value >= 0x80:
        out.append(0x80 | (value & 0x7F))
        value >>= 7
    out.append(value)


class Decoder:
    """hpack.Decoder's interface: `decode`, `max_header_list_size`, `max_allowed_table_size`."""

    def __init__(self, max_header_list_size: int = DEFAULT_MAX_HEADER_LIST_SIZE) -> None:
        self.max_header_list_size = max_header_list_size
        self.max_allowed_table_size = DEFAULT_TABLE_SIZE  # what we advertised and had acked
        self._max_size = DEFAULT_TABLE_SIZE  # set by the encoder's size updates
        self._entries: deque[HeaderTuple] = deque()  # newest first
        self._size = 0
        self._generation = 0  # changes with the dynamic table
        self.last_size = 0  # the last block's header list size (RFC 9113 §6.5.2's measure)
        # block -> (table generation, header list size, headers) of blocks that left the table
        # as it was
        self._blocks: dict[bytes, tuple[int, int, tuple[HeaderTuple, ...]]] = {}

    @property
    def header_table_size(self) -> int:
        return self._max_size

    def _get(self, index: int) -> HeaderTuple:
        if 0 < index <= _STATIC_LEN:
            return _STATIC[index - 1]
        position = index - _STATIC_LEN - 1
        if 0 <= position < len(self._entries):
            return self._entries[position]
        raise InvalidTableIndexError(f"invalid table index {index}")

    def _add(self, header: HeaderTuple) -> None:
        self._generation += 1
        size = len(header[0]) + len(header[1]) + ENTRY_OVERHEAD
        entries = self._entries
        if size > self._max_size:
            entries.clear()
            self._size = 0
            return
        self._size += size
        while self._size > self._max_size:
            old = entries.pop()
            self._size -= len(old[0]) + len(old[1]) + ENTRY_OVERHEAD
        entries.appendleft(header)

    def _resize(self, size: int) -> None:
        if size > self.max_allowed_table_size:
            raise InvalidTableSizeError("table size update above the advertised maximum")
        self._generation += 1
        self._max_size = size
        entries = self._entries
        while self._size > size:
            old = entries.pop()
            self._size -= len(old[0]) + len(old[1]) + ENTRY_OVERHEAD

    def _string(self, data: bytes, pos: int, room: int) -> tuple[bytes, int]:
        """A string literal at `pos`; refused unread when it cannot fit in `room` bytes (a
        Huffman-coded one by the least it can decode to: decoding is the costly part)."""
        if pos >= len(data):
            raise HPACKDecodingError("truncated string")
        byte = data[pos]
        length = byte & 0x7F
        pos += 1
        if length == 0x7F:
            length, pos = _integer(data, pos, length)
        end = pos + length
        if end > len(data):
            raise HPACKDecodingError("truncated string")
        if (length * 8 // _HUFFMAN_MAX_BITS if byte & 0x80 else length) > room:
            raise OversizedHeaderListError(
                f"a header list larger than {self.max_header_list_size} bytes"
            )
        if byte & 0x80:
            return _huffman(data[pos:end]), end
        return data[pos:end], end

    def decode(self, data: bytes | memoryview, raw: bool = True) -> list[HeaderTuple]:
        """Decodes a header block into (name, value) byte tuples (`raw` must be true)."""
        if not raw:
            raise ValueError("only raw (bytes) decoding is supported")
        data = bytes(data)
        limit = self.max_header_list_size
        generation = self._generation
        cached = self._blocks.get(data)
        if cached is not None and cached[0] == generation:
            if cached[1] > limit:
                raise OversizedHeaderListError(f"a header list larger than {limit} bytes")
            if self._max_size > self.max_allowed_table_size:
                raise InvalidTableSizeError("the encoder did not shrink its table")
            self.last_size = cached[1]
            return list(cached[2])
        headers: list[HeaderTuple] = []
        size = 0
        pos = 0
        end = len(data)
        while pos < end:
            byte = data[pos]
            if byte & 0x80:  # indexed field
                index = byte & 0x7F
                pos += 1
                if index == 0x7F:
                    index, pos = _integer(data, pos, index)
                header = self._get(index)
            elif byte & 0x40 or not byte & 0x20:  # a literal
                if byte & 0x40:  # with incremental indexing
                    mask = 0x3F
                    kind: type[HeaderTuple] = HeaderTuple
                else:  # without indexing, or never indexed
                    mask = 0x0F
                    kind = NeverIndexedHeaderTuple if byte & 0x10 else HeaderTuple
                index = byte & mask
                pos += 1
                if index == mask:
                    index, pos = _integer(data, pos, index)
                room = limit - size - ENTRY_OVERHEAD
                if index:
                    name = self._get(index)[0]
                else:
                    name, pos = self._string(data, pos, room)
                value, pos = self._string(data, pos, room - len(name))
                header = kind(name, value)
                if mask == 0x3F:
                    self._add(header)
            else:  # dynamic table size update: only before the first field
                if headers:
                    raise HPACKDecodingError("table size update not at the start of the block")
                new_size = byte & 0x1F
                pos += 1
                if new_size == 0x1F:
                    new_size, pos = _integer(data, pos, new_size)
                self._resize(new_size)
                continue
            size += len(header[0]) + len(header[1]) + ENTRY_OVERHEAD
            if size > limit:
                raise OversizedHeaderListError(f"a header list larger than {limit} bytes")
            headers.append(header)
        if self._max_size > self.max_allowed_table_size:
            raise InvalidTableSizeError("the encoder did not shrink its table")
        if self._generation == generation and len(data) <= _BLOCK_CACHE_LENGTH:
            blocks = self._blocks
            if len(blocks) >= _BLOCK_CACHE_ENTRIES:
                blocks.clear()
            blocks[data] = (generation, size, tuple(headers))
        self.last_size = size
        return headers


class Encoder:
    """hpack.Encoder's interface: `encode` and `header_table_size` (the peer's table size)."""

    def __init__(self) -> None:
        self._max_size = DEFAULT_TABLE_SIZE
        self._size = 0
        self._added = 0  # entries added so far: an entry's serial number
        self._entries: deque[tuple[bytes, bytes, int, int]] = deque()  # newest first
        self._fields: dict[tuple[bytes, bytes], int] = {}  # field -> serial of its newest entry
        self._names: dict[bytes, int] = {}  # name -> serial of its newest entry
        self._size_updates: list[int] = []  # to announce at the start of the next block

    @property
    def header_table_size(self) -> int:
        return self._max_size

    @header_table_size.setter
    def header_table_size(self, value: int) -> None:
        # The peer's SETTINGS_HEADER_TABLE_SIZE is what we *may* use: a peer offering gigabytes
        # does not get us to keep them.
        value = min(value, MAX_ENCODER_TABLE_SIZE)
        if value == self._max_size:
            return
        updates = self._size_updates
        # RFC 7541 §4.2: announce the smallest size since the last block, then the final one.
        if not updates:
            updates.append(value)
        elif len(updates) == 1:
            if value < updates[0]:
                updates[0] = value
            else:
                updates.append(value)
        else:
            updates[0] = min(updates[0], value)
            updates[1] = value
        self._max_size = value
        self._evict(value)

    def _evict(self, room: int) -> None:
        entries, fields, names = self._entries, self._fields, self._names
        while self._size > room:
            name, value, size, serial = entries.pop()
            self._size -= size
            if fields.get((name, value)) == serial:
                del fields[name, value]
            if names.get(name) == serial:
                del names[name]

    def encode(self, headers: Iterable[tuple[bytes, bytes]], huffman: bool = True) -> bytes:
        """Encodes a header block (literals are never Huffman-coded, whatever `huffman`)."""
        out = bytearray()
        if self._size_updates:
            for size in self._size_updates:
                _put_integer(out, size, 0x1F, 0x20)
            self._size_updates = []
        static_fields, static_names = _STATIC_FIELDS, _STATIC_NAMES
        fields, names = self._fields, self._names
        for header in headers:
            name, value = header
            indexable = type(header) is not NeverIndexedHeaderTuple
            field = (name, value)
            index = static_fields.get(field)
            if index is not None and indexable:
                out.append(0x80 | index)
                continue
            serial = fields.get(field)
            if serial is not None and indexable:
                _put_integer(out, _STATIC_LEN + 1 + self._added - serial, 0x7F, 0x80)
                continue
            name_index = static_names.get(name)
            if name_index is None:
                serial = names.get(name)
                if serial is not None:
                    name_index = _STATIC_LEN + 1 + self._added - serial
            size = len(name) + len(value) + ENTRY_OVERHEAD
            if not indexable:
                mask, flags = 0x0F, 0x10  # never indexed, here or by any later hop
            elif size > self._max_size * 3 // 4:
                mask, flags = 0x0F, 0x00  # too big to be worth a table entry
            else:
                mask, flags = 0x3F, 0x40  # with incremental indexing
            if name_index is None:
                out.append(flags)
                _put_integer(out, len(name), 0x7F, 0x00)
                out += name
            else:
                _put_integer(out, name_index, mask, flags)
            _put_integer(out, len(value), 0x7F, 0x00)
            out += value
            if flags == 0x40:
                self._evict(self._max_size - size)
                self._added += 1
                self._size += size
                self._entries.appendleft((name, value, size, self._added))
                fields[field] = self._added
                names[name] = self._added
        return bytes(out)
