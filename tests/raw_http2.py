"""A hand-made HTTP/2 client for tests whose attack is in what a client does *not* send (grpcio always sends a
call's message; the `h2` package is not installed): the connection preface, SETTINGS, HEADERS whose fields are
HPACK literals without indexing (RFC 7541 6.2.2, no Huffman, so no tables on either side), and a reader of
the frames that come back (RFC 9113 4.1: 24-bit length, type, flags, 31-bit stream id)."""

from __future__ import annotations

import socket

DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE = 0x0, 0x1, 0x3, 0x4, 0x6, 0x7, 0x8
END_STREAM = ACK = 0x1
END_HEADERS = 0x4
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream_id.to_bytes(4, "big") + payload


def hpack_int(value: int, prefix_bits: int, first: int = 0) -> bytes:
    """An HPACK integer (RFC 7541 5.1) in a prefix of `prefix_bits`, `first` holding the octet's other bits."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes([first | value])
    out, value = bytearray([first | limit]), value - limit
    while value >= 128:
        out.append(value % 128 + 128)
        value //= 128
    return bytes(out + bytearray([value]))


def literal(name: str, value: str) -> bytes:
    """One header field, literal without indexing, new name, neither string Huffman-coded."""
    n, v = name.encode(), value.encode()
    return b"\x00" + hpack_int(len(n), 7) + n + hpack_int(len(v), 7) + v


def grpc_headers(stream_id: int, path: str, authority: str, end_stream: bool = False) -> bytes:
    """The HEADERS frame that starts a gRPC call to `path` (e.g. /pkg.Service/Method), and no message."""
    block = b"".join(literal(k, v) for k, v in (
        (":method", "POST"), (":scheme", "http"), (":path", path), (":authority", authority),
        ("content-type", "application/grpc"), ("te", "trailers")))
    return frame(HEADERS, END_HEADERS | (END_STREAM if end_stream else 0), stream_id, block)


def grpc_data(stream_id: int, message: bytes, end_stream: bool = True) -> bytes:
    """One gRPC message (its 5-byte prefix: not compressed, 32-bit length) in one DATA frame."""
    payload = b"\x00" + len(message).to_bytes(4, "big") + message
    return frame(DATA, END_STREAM if end_stream else 0, stream_id, payload)


def window_update(stream_id: int, increment: int) -> bytes:
    """A WINDOW_UPDATE: `increment` more bytes the server may send on the stream (0: on the connection)."""
    return frame(WINDOW_UPDATE, 0, stream_id, increment.to_bytes(4, "big"))


def handshake(s: socket.socket) -> FrameReader:
    """Preface and an empty SETTINGS sent, the server's SETTINGS read and acknowledged."""
    s.sendall(PREFACE + frame(SETTINGS, 0, 0))
    reader = FrameReader(s)
    while True:
        kind, flags, _, _ = reader.next()
        if kind == SETTINGS and not flags & ACK:
            s.sendall(frame(SETTINGS, ACK, 0))
            return reader


class FrameReader:
    def __init__(self, s: socket.socket):
        self.s, self.buf = s, b""

    def _fill(self, n: int) -> None:
        while len(self.buf) < n:
            chunk = self.s.recv(65536)  # socket.timeout if the server sends nothing more
            if not chunk:
                raise ConnectionError(f"the server closed the connection; unread: {self.buf!r}")
            self.buf += chunk

    def next(self) -> tuple[int, int, int, bytes]:
        """The next frame: (type, flags, stream id, payload). A PING is answered (ACK) as a client must."""
        self._fill(9)
        length = int.from_bytes(self.buf[:3], "big")
        self._fill(9 + length)
        head, payload, self.buf = self.buf[:9], self.buf[9:9 + length], self.buf[9 + length:]
        kind, flags, stream_id = head[3], head[4], int.from_bytes(head[5:9], "big") & 0x7FFFFFFF
        if kind == PING and not flags & ACK:
            self.s.sendall(frame(PING, ACK, 0, payload))
        return kind, flags, stream_id, payload
