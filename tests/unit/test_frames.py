"""Unit tests of framing (``distgrad._wire._frames``): the encoder and the incremental parser."""

from __future__ import annotations

import os
import pickle
import random
import struct

import pytest

from distgrad._errors import MessageTooLargeError, ProtocolError
from distgrad._transport._memory import read_memory
from distgrad._wire import _frames
from distgrad._wire._frames import (
    FLAG_BY_REFERENCE,
    HEADER,
    MAX_BUFFERS,
    Frame,
    FrameParser,
    Kind,
    encode_frame,
    encode_frame_by_reference,
)
from tests._needs import needs

BIG = 1 << 40


def _memory_reads() -> bool:
    from distgrad._transport import _memory

    return _memory.available()


def stream_of(pieces: list[bytes | memoryview]) -> bytes:
    return b"".join(bytes(p) for p in pieces)


def feed(parser: FrameParser, data: bytes, chunks: list[int] | None = None) -> list[Frame]:
    """Push ``data`` through ``parser`` the way the transport does: ``recv_into`` the buffer the
    parser offers, at most ``chunks[i]`` bytes per read."""
    frames: list[Frame] = []
    pos = 0
    i = 0
    while pos < len(data):
        buf = parser.get_buffer()
        assert len(buf) > 0, "the parser offered no room to receive into"
        want = chunks[i % len(chunks)] if chunks else len(data)
        i += 1
        n = min(len(buf), want, len(data) - pos)
        buf[:n] = data[pos : pos + n]
        pos += n
        frames.extend(parser.buffer_updated(n))
    return frames


def random_frame(rng: random.Random, threshold: int) -> tuple[int, int, int, bytes, list[bytes]]:
    kind = rng.choice(list(Kind))
    message_id = rng.choice([0, 1, rng.getrandbits(32), (1 << 64) - 1, rng.getrandbits(64)])
    flags = rng.getrandbits(6)  # the top two bits are the transport's (by reference, in ring)
    size_choices = [0, 1, 7, rng.randrange(threshold), threshold, threshold + 1, 3 * threshold]
    meta = rng.randbytes(rng.choice(size_choices))
    buffers = [rng.randbytes(rng.choice(size_choices)) for _ in range(rng.choice([0, 0, 1, 2, 5]))]
    return kind, message_id, flags, meta, buffers


def encode(kind: int, message_id: int, flags: int, meta: bytes, buffers: list[bytes]) -> bytes:
    return stream_of(
        encode_frame(kind, message_id, meta, [pickle.PickleBuffer(b) for b in buffers], flags)
    )


def assert_same(
    frame: Frame, kind: int, message_id: int, flags: int, meta: bytes, bufs: list[bytes]
) -> None:
    assert (frame.kind, frame.message_id, frame.flags) == (kind, message_id, flags)
    assert bytes(frame.meta) == meta
    assert [bytes(b) for b in frame.buffers] == bufs


# -- encoding ----------------------------------------------------------------------------------


def test_header_layout() -> None:
    """The header is 16 bytes: kind, flags, buffer count, meta length, message id."""
    assert HEADER.size == 16
    (head,) = encode_frame(Kind.RESPONSE, 0x0102030405060708, b"meta", None, 3)
    assert head[:16] == struct.pack("<BBHIQ", 2, 3, 0, 4, 0x0102030405060708)
    assert head[16:] == b"meta"


def test_buffers_follow_their_lengths_and_are_not_copied() -> None:
    """A frame with buffers lists their u64 lengths after the header; buffers stay views."""
    payload = bytearray(b"x" * 10)
    pieces = encode_frame(
        Kind.REQUEST, 5, b"m", [pickle.PickleBuffer(payload), pickle.PickleBuffer(b"")]
    )
    head = bytes(pieces[0])
    assert struct.unpack_from("<BBHIQ", head) == (1, 0, 2, 1, 5)
    assert struct.unpack_from("<2Q", head, 16) == (10, 0)
    assert head[32:] == b"m"
    assert isinstance(pieces[1], memoryview)
    payload[0] = ord("y")  # the piece is a view of the caller's memory
    assert bytes(pieces[1])[0] == ord("y")


def test_encoder_refuses_too_many_buffers() -> None:
    """More than MAX_BUFFERS buffers in one frame is refused by the sender too."""
    buffers = [pickle.PickleBuffer(b"a")] * (MAX_BUFFERS + 1)
    with pytest.raises(ProtocolError, match=str(MAX_BUFFERS)):
        encode_frame(Kind.REQUEST, 1, b"", buffers)


# -- parsing -----------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(
    "sizes", [(256 * 1024, 64 * 1024), (1024, 256)], ids=["default-staging", "tiny-staging"]
)
def test_random_frames_in_random_chunks(seed: int, sizes: tuple[int, int]) -> None:
    """A random stream of frames fed in random chunk sizes parses into exactly those frames."""
    staging, threshold = sizes
    rng = random.Random(seed)
    frames = [random_frame(rng, threshold) for _ in range(40)]
    data = b"".join(encode(*f) for f in frames)
    chunks = [
        max(1, int(rng.expovariate(1 / rng.choice([3, 100, 5000, 200_000])))) for _ in range(500)
    ]
    parser = FrameParser(BIG, staging_size=staging, direct_threshold=threshold)
    got = feed(parser, data, chunks)
    assert len(got) == len(frames)
    for frame, expected in zip(got, frames, strict=True):
        assert_same(frame, *expected)


def test_byte_at_a_time() -> None:
    """Frames fed one byte per read (every boundary split) still parse exactly."""
    rng = random.Random(7)
    frames = [random_frame(rng, 64) for _ in range(25)]
    data = b"".join(encode(*f) for f in frames)
    got = feed(FrameParser(BIG, staging_size=256, direct_threshold=64), data, [1])
    assert len(got) == len(frames)
    for frame, expected in zip(got, frames, strict=True):
        assert_same(frame, *expected)


def test_many_small_frames_in_one_read() -> None:
    """A burst of small frames that arrives in one read comes out of one buffer_updated call."""
    frames = [(Kind.REQUEST, i, 0, os.urandom(i % 50), []) for i in range(1000)]
    data = b"".join(encode(*f) for f in frames)
    parser = FrameParser(BIG)
    buf = parser.get_buffer()
    assert len(buf) >= len(data)
    buf[: len(data)] = data
    got = parser.buffer_updated(len(data))
    assert [f.message_id for f in got] == list(range(1000))
    assert all(bytes(f.meta) == e[3] for f, e in zip(got, frames, strict=True))


def test_large_buffer_is_received_in_place() -> None:
    """A buffer above the direct threshold is received straight into its final memory."""
    payload = os.urandom(300_000)
    data = encode(Kind.RESPONSE, 9, 0, b"meta", [payload])
    parser = FrameParser(BIG)
    frames = feed(parser, data[:1000])
    assert frames == []
    target = parser.get_buffer()  # the parser now offers the buffer's own memory
    assert len(target) == 300_000 - (1000 - 16 - 8 - 4)
    frames = feed(parser, data[1000:])
    assert len(frames) == 1
    (buf,) = frames[0].buffers
    assert bytes(buf) == payload


def test_frames_after_a_large_one_share_its_last_read() -> None:
    """Bytes of the next frames that arrive in the same read as a large frame's end are kept."""
    big = (Kind.REQUEST, 1, 0, b"", [os.urandom(200_000)])
    small = [(Kind.RESPONSE, i, 1, os.urandom(10), []) for i in range(2, 6)]
    data = encode(*big) + b"".join(encode(*s) for s in small)
    got = feed(FrameParser(BIG), data, [150_000, 70_000])
    assert [f.message_id for f in got] == [1, 2, 3, 4, 5]
    assert bytes(got[0].buffers[0]) == big[4][0]


# -- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", [0, 12, 99, 255])
@pytest.mark.parametrize("whole", [True, False], ids=["whole-frame", "header-only"])
def test_unknown_kind_is_a_protocol_error(kind: int, whole: bool) -> None:
    """An unknown frame kind raises ProtocolError, whether or not the frame body has arrived."""
    data = HEADER.pack(kind, 0, 0, 4, 1) + (b"meta" if whole else b"")
    with pytest.raises(ProtocolError, match=f"unknown frame kind {kind}"):
        feed(FrameParser(BIG), data)


def test_unknown_kind_after_good_frames() -> None:
    """A bad header right after a good frame in the same read still raises ProtocolError."""
    data = encode(Kind.REQUEST, 1, 0, b"ok", []) + HEADER.pack(77, 0, 0, 0, 2)
    with pytest.raises(ProtocolError):
        feed(FrameParser(BIG), data)


def test_oversized_meta_is_refused_on_the_header_alone() -> None:
    """A header announcing a pickle stream above the maximum is refused from its 16 bytes."""
    parser = FrameParser(max_message_size=1000)
    with pytest.raises(MessageTooLargeError, match="maximum message size is 1000"):
        feed(parser, HEADER.pack(Kind.REQUEST, 0, 0, 0xFFFFFFFF, 1))


@pytest.mark.parametrize("length", [1001, 1 << 62, (1 << 64) - 1])
def test_oversized_buffer_is_refused_before_any_allocation(
    length: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A frame announcing a buffer above the maximum is refused once its lengths are read,
    before any memory is allocated for it (an allocation of 2**62 bytes could not succeed)."""
    allocations: list[int] = []
    real = _frames.allocate_buffer
    monkeypatch.setattr(_frames, "allocate_buffer", lambda n: allocations.append(n) or real(n))
    parser = FrameParser(max_message_size=1000)
    data = HEADER.pack(Kind.REQUEST, 0, 1, 0, 1) + struct.pack("<Q", length)
    with pytest.raises(MessageTooLargeError, match="maximum message size is 1000"):
        feed(parser, data)
    assert allocations == []


def test_sum_of_buffers_counts_against_the_maximum() -> None:
    """Many buffers each under the maximum but together over it are refused."""
    parser = FrameParser(max_message_size=1000)
    data = HEADER.pack(Kind.REQUEST, 0, 3, 100, 1) + struct.pack("<3Q", 300, 300, 301)
    with pytest.raises(MessageTooLargeError, match="1001 bytes"):
        feed(parser, data)


def test_message_at_the_maximum_is_accepted() -> None:
    """A message of exactly the maximum size (meta plus buffers) is accepted."""
    data = encode(Kind.REQUEST, 3, 0, b"m" * 100, [b"b" * 900])
    (frame,) = feed(FrameParser(max_message_size=1000), data, [7])
    assert bytes(frame.buffers[0]) == b"b" * 900


def test_too_many_buffers_is_a_protocol_error() -> None:
    """A header announcing more than MAX_BUFFERS buffers is refused from the header alone."""
    with pytest.raises(ProtocolError, match=f"the limit is {MAX_BUFFERS}"):
        feed(FrameParser(BIG), HEADER.pack(Kind.REQUEST, 0, MAX_BUFFERS + 1, 0, 1))


def test_max_buffers_is_accepted() -> None:
    """Exactly MAX_BUFFERS (empty) buffers is a valid frame."""
    data = encode(Kind.REQUEST, 1, 0, b"", [b""] * MAX_BUFFERS)
    (frame,) = feed(FrameParser(BIG), data, [4000])
    assert len(frame.buffers) == MAX_BUFFERS


class _CountingParser(FrameParser):
    """A parser that counts the frames its general, step-by-step path produced."""

    general = 0

    def _parse_one(self) -> Frame | None:
        frame = super()._parse_one()
        if frame is not None:
            self.general += 1
        return frame


@pytest.mark.parametrize("seed", range(4))
def test_whole_frames_with_few_buffers_take_the_one_pass_path(seed: int) -> None:
    """A tensor-carrying frame that arrives whole -- up to 8 buffers, each below the direct-read
    size -- is parsed in one pass (not by the general parser), and comes out exactly as sent:
    kind, id, flags, meta and every buffer, writable and its own memory."""
    rng = random.Random(seed)
    parser = _CountingParser(BIG, staging_size=256 * 1024, direct_threshold=64 * 1024)
    for _ in range(30):
        kind = rng.choice(list(Kind))
        message_id = rng.getrandbits(64)
        flags = rng.getrandbits(6)
        meta = rng.randbytes(rng.choice([0, 1, 90, 4000]))
        buffers = [
            rng.randbytes(rng.choice([0, 1, 1024, 64 * 1024 - 1])) for _ in range(rng.randint(1, 8))
        ]
        data = encode(kind, message_id, flags, meta, buffers)
        if len(data) > 256 * 1024:
            continue
        (frame,) = feed(parser, data)
        assert_same(frame, kind, message_id, flags, meta, buffers)
        assert all(not b.readonly for b in frame.buffers)
    assert parser.general == 0


def test_frames_the_one_pass_path_leaves_to_the_general_parser() -> None:
    """Nine buffers, a buffer at the direct-read size, or a frame not yet whole: the general
    parser takes them, and they come out the same."""
    parser = _CountingParser(BIG, staging_size=256 * 1024, direct_threshold=64 * 1024)
    cases = [
        (b"m", [b"x"] * 9),
        (b"m", [b"y" * (64 * 1024)]),
    ]
    for meta, buffers in cases:
        (frame,) = feed(parser, encode(Kind.REQUEST, 4, 0, meta, buffers))
        assert_same(frame, Kind.REQUEST, 4, 0, meta, buffers)
    data = encode(Kind.RESPONSE, 5, 1, b"meta", [b"a" * 100, b"b" * 3])
    (frame,) = feed(parser, data, [len(data) - 1])
    assert_same(frame, Kind.RESPONSE, 5, 1, b"meta", [b"a" * 100, b"b" * 3])
    assert parser.general == 3


def test_a_whole_frame_over_the_maximum_is_refused() -> None:
    """A whole frame with buffers whose sum passes the maximum is refused as when it arrives
    in pieces, and one whose lengths are lies (announced, not sent) is waited for, not read
    past its end."""
    data = encode(Kind.REQUEST, 1, 0, b"m" * 100, [b"b" * 600, b"c" * 301])
    with pytest.raises(MessageTooLargeError, match="1001 bytes"):
        feed(FrameParser(max_message_size=1000), data)
    short = HEADER.pack(Kind.REQUEST, 0, 1, 2, 1) + struct.pack("<Q", 50) + b"mm" + b"z" * 10
    parser = FrameParser(BIG)
    assert feed(parser, short) == []
    (frame,) = feed(parser, b"z" * 40)
    assert bytes(frame.buffers[0]) == b"z" * 50


def test_small_oversized_frame_arriving_whole_is_refused() -> None:
    """A frame above a small maximum is refused even when it arrives in one read."""
    data = encode(Kind.REQUEST, 1, 0, b"x" * 100, [])
    with pytest.raises(MessageTooLargeError):
        feed(FrameParser(max_message_size=16), data)


def test_parser_rejects_a_threshold_above_half_the_staging() -> None:
    """The parser's construction rule: the direct threshold is at most half the staging."""
    with pytest.raises(ValueError, match="direct_threshold"):
        FrameParser(BIG, staging_size=1000, direct_threshold=501)


# -- buffers by reference ----------------------------------------------------------------------


def read_own_memory(address: int, into: memoryview) -> None:
    read_memory(os.getpid(), address, into)


def by_reference(buffers: list[bytes], threshold: int, transfer: int = 5) -> tuple[bytes, list]:
    pieces, kept = encode_frame_by_reference(
        Kind.REQUEST, 9, b"meta", [pickle.PickleBuffer(b) for b in buffers], 1, transfer, threshold
    )
    return stream_of(pieces), kept


@needs(None if _memory_reads() else "needs Linux process_vm_readv")
@pytest.mark.parametrize("chunks", [None, [1], [3, 17, 5000]])
def test_by_reference_buffers_are_read_from_memory_not_the_stream(chunks: list[int] | None) -> None:
    """Large buffers stay behind (only their address travels) and the parser reads them; small
    ones travel inline; the frame names the transfer to release and keeps the layer's flags."""
    small, large = os.urandom(100), os.urandom(300_000)
    data, kept = by_reference([small, large, b"", large[:70_000]], threshold=65_536)
    assert len(data) < 2_000  # neither large buffer is in the stream
    assert [v.nbytes for v in kept] == [300_000, 70_000]
    assert data[1] & FLAG_BY_REFERENCE
    frames = feed(FrameParser(BIG, read_remote=read_own_memory), data, chunks)
    assert len(frames) == 1
    assert_same(frames[0], Kind.REQUEST, 9, 1, b"meta", [small, large, b"", large[:70_000]])
    assert frames[0].transfer == 5
    plain = feed(FrameParser(BIG), encode(Kind.REQUEST, 9, 1, b"meta", [small]))
    assert plain[0].transfer == -1


def test_by_reference_frame_without_a_reader_is_a_protocol_error() -> None:
    """A connection that did not accept the peer's offer refuses frames by reference."""
    data, _kept = by_reference([os.urandom(1000)], threshold=10)
    with pytest.raises(ProtocolError, match="did not agree"):
        feed(FrameParser(BIG), data)


@needs(None if _memory_reads() else "needs Linux process_vm_readv")
def test_by_reference_frame_at_an_unmapped_address_is_a_protocol_error() -> None:
    """An address the sender does not have mapped is a protocol error, not a crash."""
    data, _kept = by_reference([os.urandom(1000)], threshold=10)
    lengths_end = HEADER.size + 8 + 8  # one length, then the transfer id, then the address
    forged = data[:lengths_end] + struct.pack("<Q", 4096) + data[lengths_end + 8 :]
    with pytest.raises(ProtocolError, match="could not read a 1000-byte buffer"):
        feed(FrameParser(BIG, read_remote=read_own_memory), forged)


def test_by_reference_lengths_count_against_the_maximum() -> None:
    """Buffers left in the sender's memory are bounded like inline ones, before any read."""
    data, _kept = by_reference([os.urandom(1000)], threshold=10)

    def never(address: int, into: memoryview) -> None:
        raise AssertionError("read before the size check")

    with pytest.raises(MessageTooLargeError):
        feed(FrameParser(500, read_remote=never), data)


def test_encoder_refuses_the_transport_flag() -> None:
    """The layer above cannot set the transport's own flag bit."""
    with pytest.raises(ValueError, match="reserved"):
        encode_frame(Kind.REQUEST, 1, b"", None, FLAG_BY_REFERENCE)


@pytest.mark.skipif(not _memory_reads(), reason="needs Linux process_vm_readv")
def test_buffers_the_reader_could_not_read_travel_inline() -> None:
    """Large buffers that ``readable`` refuses (the sender's probe of memory the kernel will
    not let the peer read, such as pinned CUDA host memory) travel inline; the others stay
    behind; the parser rebuilds the same frame (issue 29, item 1)."""
    small, pinned, heap = os.urandom(100), os.urandom(300_000), os.urandom(200_000)
    buffers = [pickle.PickleBuffer(b) for b in (small, pinned, heap)]
    refused = buffers[1].raw()
    pieces, kept = encode_frame_by_reference(
        Kind.REQUEST, 9, b"meta", buffers, 1, 5, 65_536, lambda v: v.obj is not refused.obj
    )
    assert [v.nbytes for v in kept] == [200_000]
    data = stream_of(pieces)
    assert 300_000 < len(data) < 302_000  # the refused buffer is in the stream, the other not
    frames = feed(FrameParser(BIG, read_remote=read_own_memory), data, None)
    assert_same(frames[0], Kind.REQUEST, 9, 1, b"meta", [small, pinned, heap])
