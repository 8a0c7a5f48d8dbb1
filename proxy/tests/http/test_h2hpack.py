"""The proxy's HPACK against the reference `hpack` library, both ways, on random header lists."""

from __future__ import annotations

import time

import hpack
import hpack.huffman
import hpack.huffman_constants
import pytest
from hpack import HeaderTuple, NeverIndexedHeaderTuple
from hpack.exceptions import HPACKDecodingError, InvalidTableSizeError, OversizedHeaderListError
from hypothesis import given, settings
from hypothesis import strategies as st

from meshlet.proxy.http import h2hpack
from meshlet.proxy.http.h2hpack import Decoder, Encoder

# Names and values drawn from a small pool, so that blocks repeat fields (the table is used),
# plus arbitrary bytes (literals, Huffman in the reference encoder).
_common = st.sampled_from(
    [b":method", b":path", b"content-type", b"grpc-status", b"x-id", b"te", b"accept", b"cookie"]
)
_names = _common | st.binary(min_size=1, max_size=20)
_values = st.sampled_from([b"", b"GET", b"/", b"0", b"application/grpc"]) | st.binary(max_size=300)
_header = st.builds(
    lambda name, value, sensitive: (NeverIndexedHeaderTuple if sensitive else HeaderTuple)(
        name, value
    ),
    _names,
    _values,
    st.booleans(),
)
# A connection's life: blocks, with occasional table size changes in between.
_blocks = st.lists(
    st.tuples(st.lists(_header, max_size=12), st.none() | st.integers(0, 8192)), max_size=12
)


def _same(got: list[HeaderTuple], sent: list[HeaderTuple], flags: bool = True) -> None:
    assert [(bytes(n), bytes(v)) for n, v in got] == [(n, v) for n, v in sent]
    for g, s in zip(got, sent, strict=True):  # never-indexed survives the trip
        assert not flags or isinstance(g, NeverIndexedHeaderTuple) == isinstance(
            s, NeverIndexedHeaderTuple
        )


@settings(max_examples=300, deadline=None)
@given(_blocks)
def test_what_we_encode_the_reference_decodes(
    blocks: list[tuple[list[HeaderTuple], int | None]],
) -> None:
    encoder, decoder = Encoder(), hpack.Decoder(max_header_list_size=1 << 30)
    decoder.max_allowed_table_size = 8192
    for headers, table_size in blocks:
        if table_size is not None:
            encoder.header_table_size = table_size
        _same(decoder.decode(encoder.encode(headers), raw=True), headers)


@settings(max_examples=300, deadline=None)
@given(_blocks, st.booleans())
def test_what_the_reference_encodes_we_decode(
    blocks: list[tuple[list[HeaderTuple], int | None]], huffman: bool
) -> None:
    encoder, decoder = hpack.Encoder(), Decoder(max_header_list_size=1 << 30)
    decoder.max_allowed_table_size = 8192
    for headers, table_size in blocks:
        if table_size is not None:
            encoder.header_table_size = table_size
        block = encoder.encode(headers, huffman=huffman)
        # (hpack itself indexes a never-indexed field already in its table: flags not compared)
        _same(decoder.decode(block), headers, flags=False)


def test_repeated_fields_become_one_byte_each() -> None:
    encoder = Encoder()
    headers = [(b":method", b"POST"), (b":path", b"/pkg.Svc/Call"), (b"x-custom", b"abc")]
    first = encoder.encode(headers)
    assert len(encoder.encode(headers)) == 3 < len(first)


def test_sensitive_fields_stay_out_of_the_table() -> None:
    encoder = Encoder()
    secret = [NeverIndexedHeaderTuple(b"authorization", b"Bearer secret")]
    assert encoder.encode(secret) == encoder.encode(secret)  # never shrinks to an index
    assert encoder.encode(secret)[0] & 0xF0 == 0x10  # literal never indexed


def test_table_size_updates_are_announced_smallest_first() -> None:
    encoder, decoder = Encoder(), hpack.Decoder()
    decoder.decode(encoder.encode([(b"x-a", b"1")]), raw=True)
    encoder.header_table_size = 0  # the peer shrank its table, then grew it again
    encoder.header_table_size = 4096
    block = encoder.encode([(b"x-a", b"1")])
    assert block[:4] == bytes([0x20, 0x3F, 0xE1, 0x1F])  # size 0, then size 4096
    assert decoder.decode(block, raw=True) == [(b"x-a", b"1")]  # re-sent as a literal


@pytest.mark.parametrize(
    ("block", "error"),
    [
        (bytes([0x80]), HPACKDecodingError),  # index 0
        (bytes([0xBE]), HPACKDecodingError),  # index 62: the dynamic table is empty
        (bytes([0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0x7F]), HPACKDecodingError),  # endless integer
        (bytes([0x40, 0x05]) + b"ab", HPACKDecodingError),  # truncated name
        (bytes([0x82, 0x20]), HPACKDecodingError),  # size update after a field
        (bytes([0x3F, 0xE2, 0x1F]), InvalidTableSizeError),  # size update above 4096
        (bytes([0x40, 0x81, 0xFF, 0x01]) + b"a", HPACKDecodingError),  # bad Huffman
    ],
)
def test_malformed_blocks_are_errors(block: bytes, error: type[Exception]) -> None:
    with pytest.raises(error):
        Decoder().decode(block)


def test_an_hpack_bomb_is_stopped_by_the_header_list_limit() -> None:
    block = hpack.Encoder().encode([(b"x-bomb", b"b" * 4000)]) + bytes([0x80 | 62]) * 100
    with pytest.raises(OversizedHeaderListError):
        Decoder(max_header_list_size=65536).decode(block)


def test_a_peer_offering_a_huge_table_does_not_get_us_to_keep_one() -> None:
    encoder, decoder = Encoder(), hpack.Decoder()
    decoder.max_allowed_table_size = 1 << 30
    encoder.header_table_size = 1 << 30  # the peer's SETTINGS_HEADER_TABLE_SIZE
    for i in range(1000):
        decoder.decode(encoder.encode([(b"x-unique", b"%d" % i * 10)]), raw=True)
    assert decoder.header_table_size <= 4096  # what the encoder announced and used
    entries = decoder.header_table.dynamic_entries
    assert sum(len(n) + len(v) + 32 for n, v in entries) <= 4096


@settings(max_examples=300, deadline=None)
@given(_blocks, st.lists(st.integers(0, 11), max_size=30))
def test_repeated_blocks_decode_as_the_table_says_now(
    blocks: list[tuple[list[HeaderTuple], int | None]], order: list[int]
) -> None:
    """Header lists sent again in any order (a peer that indexes sends the same bytes): what
    a block decodes to follows the table as it is now, cached or not."""
    encoder, decoder = hpack.Encoder(), Decoder(max_header_list_size=1 << 30)
    decoder.max_allowed_table_size = 8192
    for turn, pick in enumerate(order if blocks else []):
        headers, table_size = blocks[pick % len(blocks)]
        if table_size is not None and turn % 3 == 0:  # now and then the table changes size
            encoder.header_table_size = table_size
        for _ in range(2):  # the second time, fields already in the table are indexed
            _same(decoder.decode(encoder.encode(headers)), headers, flags=False)


def test_a_cached_block_follows_the_table_and_the_limit() -> None:
    decoder = Decoder()
    decoder.decode(bytes([0x40, 3]) + b"x-a" + bytes([1]) + b"1")  # adds x-a: 1 as entry 62
    newest = bytes([0x80 | 62])
    assert decoder.decode(newest) == decoder.decode(newest) == [(b"x-a", b"1")]
    decoder.decode(bytes([0x40, 3]) + b"x-b" + bytes([1]) + b"2")  # now 62 is x-b: 2
    assert decoder.decode(newest) == [(b"x-b", b"2")]
    decoder.max_header_list_size = 10  # lowered: the cached block no longer fits
    with pytest.raises(OversizedHeaderListError):
        decoder.decode(newest)
    assert len(decoder._blocks) <= h2hpack._BLOCK_CACHE_ENTRIES


def test_huffman_literals_a_peer_repeats_decode_the_same_from_the_cache() -> None:
    """nginx sends its response headers as Huffman-coded literals, never indexed: the same
    strings again and again, decoded once and then looked up."""
    fields = [(b"server", b"nginx/1.22.1"), (b"date", b"Mon, 23 Nov 2026 20:40:00 GMT")]
    block = hpack.Encoder().encode([NeverIndexedHeaderTuple(k, v) for k, v in fields])
    decoder = Decoder()
    first, again = decoder.decode(block), decoder.decode(block)
    assert [tuple(h) for h in first] == [tuple(h) for h in again] == fields
    assert b"nginx/1.22.1" in h2hpack._HUFFMAN_CACHE.values()


def test_the_huffman_cache_is_bounded() -> None:
    h2hpack._HUFFMAN_CACHE.clear()
    encoder = hpack.Encoder()
    for i in range(h2hpack._HUFFMAN_CACHE_ENTRIES + 10):
        value = f"value-{i}".encode()
        got = Decoder().decode(encoder.encode([NeverIndexedHeaderTuple(b"x-n", value)]))
        assert got[0][1] == value
    assert len(h2hpack._HUFFMAN_CACHE) <= h2hpack._HUFFMAN_CACHE_ENTRIES
    long = b"v" * 200  # past the cached length: decoded, not kept
    got = Decoder().decode(encoder.encode([NeverIndexedHeaderTuple(b"x-long", long)]))
    assert got[0][1] == long and long not in h2hpack._HUFFMAN_CACHE.values()


def test_a_huffman_literal_too_long_to_fit_is_refused_before_it_is_decoded() -> None:
    """437 KB of Huffman code (`a` is 5 bits: 700,000 octets) took ~170 ms to decode before
    the header list's limit refused it: a peer could buy that CPU with every connection."""
    eight = hpack.huffman.HuffmanEncoder(
        hpack.huffman_constants.REQUEST_CODES, hpack.huffman_constants.REQUEST_CODES_LENGTH
    ).encode(b"a" * 8)
    coded = eight * 87_500  # 5 bytes for 8 octets, on byte boundaries
    block = bytearray([0x00, 0x01]) + b"x"  # a literal, not indexed, with a new name "x"
    h2hpack._put_integer(block, len(coded), 0x7F, 0x80)
    block += coded
    started = time.process_time()
    with pytest.raises(OversizedHeaderListError):
        Decoder(max_header_list_size=65536).decode(bytes(block))
    assert time.process_time() - started < 0.05


def test_the_least_a_huffman_literal_decodes_to_is_a_lower_bound() -> None:
    """No literal that fits is refused early: the longest codes (30 bits) decode to the
    fewest octets, and a value exactly at the limit still decodes."""
    value = bytes([10, 13, 22]) * 100  # among the 30-bit codes
    block = Encoder().encode([(b"x", value)])
    coded = hpack.Encoder().encode([(b"x", value)], huffman=True)
    limit = len(b"x") + len(value) + 32
    assert Decoder(max_header_list_size=limit).decode(coded) == [(b"x", value)]
    assert Decoder(max_header_list_size=limit).decode(block) == [(b"x", value)]
    with pytest.raises(OversizedHeaderListError):
        Decoder(max_header_list_size=limit - 1).decode(coded)
