"""Reading large Redis values without holding the GIL: ``read_values``.

redis-py (with hiredis or without) builds every reply as a new ``bytes`` object: a
large allocation and a copy per value, both while holding the GIL. A spill read
runs on kvtier's I/O thread, inside the engine's process, so the engine's own thread
waits for those copies (``benchmarks/bench_redis_reads.py`` measures what reads on a
thread cost a Python + torch loop beside them, redis-py's and these).

Here the replies of pipelined GETs are read with ``recv_into`` straight into one
buffer per thread, reused from call to call: the kernel copies each value into it
while the GIL is released, and nothing is allocated once the buffer has grown to
the largest value the thread has read. Each value goes to the sink as a view of
that buffer, valid only during the call (as ``ValueSink`` says), before the next
one is read.

Round trips. The GETs are sent in groups, each asking for at most
``ROUND_TRIP_BYTES`` of values (by the caller's expected value size, or the largest
value read so far; with neither, the first group is one GET), the next group sent
once the last reply of the one before is in. Redis builds the replies of a whole
pipeline in its memory before they drain, serving no other client meanwhile: a
pipeline of many large values holds up every other client's commands (the
scheduler's lookups) for all of it, and reads slower than groups of a few
(``benchmarks/bench_redis_reads.py``, its ``lookup p99`` rows). Small values still
go many to a round trip.

Protocol. Only what a GET (or GETEX) answers is accepted: a bulk string
(``$<n>``), nil (``$-1``, or RESP3's ``_``) or an error (``-...``), which comes back
as a ``ResponseError`` in that command's place, as redis-py's pipeline gives it. A
simple string (``+...``) is a value too: Redis never sends one for a value, but other
RESP servers may (fakeredis's TCP server does for a value without CR or LF), and
redis-py's own parsers take it. Anything else, a closed connection or a timeout (the
connection's ``socket_timeout``) raises a redis-py error; the connection is then
disconnected, since what is left of its replies is unknown.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Sequence

from redis.connection import (
    Connection,
    ConnectionPool,
    SSLConnection,
    UnixDomainSocketConnection,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import InvalidResponse, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from kvtier.tiers.base import ValueSink

__all__ = ["read_values", "reads_sockets"]

_HEADER_READ = 4096  # bytes asked for while a reply's header line is incomplete
ROUND_TRIP_BYTES = 4 << 20  # values asked for per round trip, at most (module docstring)
_buffers = threading.local()  # .buf: this thread's reused bytearray
_SOCKET_CONNECTS = {c._connect for c in (Connection, SSLConnection, UnixDomainSocketConnection)}


def reads_sockets(pool: ConnectionPool) -> bool:
    """Whether ``pool``'s connections are redis-py's own, on a socket ``read_values``
    can read (TCP, TLS or Unix; not an in-process fake such as fakeredis)."""
    return pool.connection_class._connect in _SOCKET_CONNECTS


def read_values(
    conn: Connection,
    commands: Sequence[tuple[bytes | str, ...]],
    sink: ValueSink,
    expected_size: int = 0,
) -> list[bool | ResponseError]:
    """Send ``commands`` (each a GET or GETEX) on ``conn``, pipelined in groups of at
    most ``ROUND_TRIP_BYTES`` of values of ``expected_size`` (module docstring), and
    read their replies: ``sink(i, value)`` for each value, in order; returns per
    command whether it found a value, or its error reply. On any other failure
    ``conn`` is disconnected and a redis-py error raised (an exception from ``sink``
    propagates as it is)."""
    replies = _Replies(conn, expected_size)
    out: list[bool | ResponseError] = []
    try:
        while len(out) < len(commands):
            if replies.largest:
                n = max(1, ROUND_TRIP_BYTES // replies.largest)
            else:  # one GET to learn the size, then (values all absent so far) the rest
                n = 1 if not out else len(commands)
            group = commands[len(out) : len(out) + n]
            conn.send_packed_command(conn.pack_commands(group))
            out += replies.read(len(out), len(group), sink)
        return out
    except BaseException:
        conn.disconnect()
        raise


class _Replies:
    """The replies arriving on one connection, parsed in this thread's buffer:
    ``buf[pos:end]`` holds bytes received and not yet parsed."""

    def __init__(self, conn: Connection, expected_size: int) -> None:
        self.sock: socket.socket = conn._sock  # type: ignore[attr-defined]
        if not hasattr(_buffers, "buf"):
            _buffers.buf = bytearray(1 << 16)
        self.buf: bytearray = _buffers.buf
        self.pos = self.end = 0
        self.largest = expected_size  # bytes of the largest value expected or read

    def read(self, first: int, n: int, sink: ValueSink) -> list[bool | ResponseError]:
        """The next ``n`` replies, those of commands ``first, first + 1, ...``."""
        out: list[bool | ResponseError] = []
        for i in range(first, first + n):
            line = self._line()
            kind = line[:1]
            if kind == b"$" and line != b"$-1":
                size = int(line[1:])
                self.largest = max(self.largest, size)
                self._fill(size + 2)  # the value and its CRLF
                with memoryview(self.buf)[self.pos : self.pos + size] as value:
                    sink(i, value)
                self.pos += size + 2
                out.append(True)
            elif kind == b"+":  # a value without CR or LF, from a server not Redis
                self.largest = max(self.largest, len(line) - 1)
                with memoryview(line)[1:] as value:
                    sink(i, value)
                out.append(True)
            elif kind == b"$" or kind == b"_":
                out.append(False)
            elif kind == b"-":
                out.append(ResponseError(line[1:].decode(errors="replace")))
            else:
                raise InvalidResponse(f"unexpected reply to a GET: {line[:40]!r}")
        return out

    def _line(self) -> bytes:
        """The next header line (without its CRLF), received as needed."""
        while (nl := self.buf.find(b"\r\n", self.pos, self.end)) < 0:
            self._fill(self.end - self.pos + _HEADER_READ, at_least=1)
        line = bytes(self.buf[self.pos : nl])
        self.pos = nl + 2
        return line

    def _fill(self, size: int, at_least: int | None = None) -> None:
        """Receive until ``buf[pos:]`` holds ``size`` bytes (with ``at_least``: until
        that many more arrived, room made for ``size``), moving what is unparsed to
        the front or into a larger buffer first."""
        want = size if at_least is None else self.end - self.pos + at_least
        if self.end - self.pos >= want:
            return
        if self.pos + size > len(self.buf):
            self._make_room(size)
        view = memoryview(self.buf)
        try:
            while self.end - self.pos < want:
                got = self.sock.recv_into(view[self.end : self.pos + size])
                if not got:
                    raise RedisConnectionError("Connection closed by server.")
                self.end += got
        except TimeoutError as e:  # socket.timeout: the connection's socket_timeout
            raise RedisTimeoutError("Timeout reading from socket") from e
        except OSError as e:
            raise RedisConnectionError(f"Error while reading from socket: {e}") from e
        finally:
            view.release()

    def _make_room(self, size: int) -> None:
        """Move the unparsed bytes to the front, into a buffer of at least ``size``
        bytes (this thread's from now on when it had to grow)."""
        unparsed = self.end - self.pos
        if size > len(self.buf):
            grown = bytearray(max(size, 2 * len(self.buf)))
            grown[:unparsed] = self.buf[self.pos : self.end]
            self.buf = _buffers.buf = grown
        else:
            self.buf[:unparsed] = self.buf[self.pos : self.end]
        self.pos, self.end = 0, unparsed
