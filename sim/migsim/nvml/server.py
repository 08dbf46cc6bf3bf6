"""The simulator process behind the simulated ``libnvidia-ml.so.1`` of one node.

``python -m migsim.nvml.server --state FILE --socket PATH`` answers the calls the C library
forwards (wire format: ``migsim.nvml.abi``) by rebuilding their ctypes arguments and calling the
node's ``SimulatedNvmlLibrary``: the same code, the same state file, the same fault injection and
call counts as pynvml in-process. One library serves every connection (so a handle's token is the
same in every process); each connection's nvmlInit is undone when it closes. Calls are serialised.
Each connection sees what its init call said its process may see (migsim.nvml.visibility), and
the simulated nvidia-smi's GPU reset comes here too (abi.RESET_GPU).

The simulated gpu-workload's hold (abi.HOLD_DEVICES) puts the connection's peer process (its pid
as the kernel gives it to this server, SO_PEERCRED: the host's, as NVML reports) on the devices
it sees; those process entries carry this server's socket path (SimProcess.held_via) and are
removed when the connection closes (however the process ended) and, left by a server that died,
when a server on the same socket starts.

The socket appears (renamed into place) only once it accepts connections.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import signal
import socket
import socketserver
import struct
import sys
import threading
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any

from migsim.nvml import abi
from migsim.nvml import state as st
from migsim.nvml.library import SimulatedNvmlLibrary, SimulatedNvmlMisuse
from migsim.nvml.visibility import EVERYTHING, Visibility

_INIT_FUNCTIONS = ("nvmlInit_v2", "nvmlInitWithFlags")
_NULL_TEXT = 0xFFFFFFFF
_LATEST_ONLY = 0xFFFFFFFFFFFFFFFF  # the event poll's cursor when an event set is created


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise ValueError("request shorter than its parameters")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str) -> int:
        value: int = struct.unpack("=" + fmt, self.take(struct.calcsize("=" + fmt)))[0]
        return value


Reply = Callable[[int], bytes]


@dataclass
class _Client:
    """One connection: its nvmlInit count and what its process sees."""

    inits: int = 0
    view: Visibility = EVERYTHING
    pid: int = 0  # the peer's, as this server's pid namespace numbers it (0: unknown)
    holding: bool = False


def _visibility(r: _Reader) -> Visibility:
    if r.pos == len(r.data):
        return EVERYTHING
    n = r.unpack("I")
    if n == abi.VISIBLE_EVERYTHING:
        return EVERYTHING
    return Visibility.of(r.take(r.unpack("I")).decode(errors="replace") for _ in range(n))


def _decode(fn: abi.Function, r: _Reader) -> tuple[list[Any], list[Reply]]:
    """The ctypes arguments of a call, and per out-parameter how to encode it after the call."""
    args: list[Any] = []
    replies: list[Reply] = []
    for kind in fn.params:
        match kind:
            case abi.Handle():
                token = r.unpack("Q")
                args.append(ctypes.c_void_p(token) if token else None)
            case abi.HandleOut():
                if r.unpack("B"):
                    out = ctypes.c_void_p()
                    args.append(ctypes.byref(out))
                    replies.append(_handle_reply(out))
                else:
                    args.append(None)
            case abi.UInt():
                args.append(r.unpack("I"))
            case abi.Int():
                args.append(r.unpack("i"))
            case abi.Text():
                n = r.unpack("I")
                args.append(None if n == _NULL_TEXT else ctypes.c_char_p(r.take(n)))
            case abi.TextOut():
                present, capacity = r.unpack("B"), r.unpack("I")
                buf = ctypes.create_string_buffer(capacity) if present else None
                args.append(buf)
                if buf is not None:
                    replies.append(_text_reply(buf))
            case abi.Ptr(ctype=t, inout=inout):
                if r.unpack("B"):
                    obj = t.from_buffer_copy(r.take(ctypes.sizeof(t)))
                    args.append(ctypes.byref(obj))
                    if inout:
                        replies.append(_bytes_reply(obj))
                else:
                    args.append(None)
            case abi.Array(ctype=t, mode=mode):
                present, n = r.unpack("B"), r.unpack("I")
                elem: Any = ctypes.c_void_p if t is None else t
                if mode == "inout":
                    arr = (elem * n).from_buffer_copy(r.take(n * ctypes.sizeof(elem)))
                elif mode == "capacity":
                    arr = (elem * n)()
                else:
                    arr = (elem * abi.UNBOUNDED_ARRAY)()
                args.append(arr if present else None)
                if present:
                    replies.append(_array_reply(arr, kind, args))
    return args, replies


def _handle_reply(out: ctypes.c_void_p) -> Reply:
    return lambda _code: struct.pack("=Q", out.value or 0)


def _text_reply(buf: ctypes.Array[ctypes.c_char]) -> Reply:
    return lambda code: _counted(buf.value + b"\0" if code == st.SUCCESS else b"", 1)


def _bytes_reply(obj: Any) -> Reply:
    return lambda _code: bytes(obj)


def _counted(data: bytes, size: int) -> bytes:
    return struct.pack("=I", len(data) // size) + data


def _array_reply(arr: Any, kind: abi.Array, args: list[Any]) -> Reply:
    def reply(code: int) -> bytes:
        if kind.mode == "inout":
            k = len(arr)
        elif code != st.SUCCESS:
            k = 0
        else:
            count = args[kind.count]
            k = 0 if count is None else min(int(count._obj.value), len(arr))
        if kind.ctype is None:
            return _counted(b"".join(struct.pack("=Q", arr[i] or 0) for i in range(k)), 8)
        size = ctypes.sizeof(arr) // len(arr)
        return _counted(ctypes.string_at(ctypes.addressof(arr), k * size), size)

    return reply


class NvmlServer(socketserver.ThreadingUnixStreamServer):
    """Serves one node's state file on a unix socket."""

    daemon_threads = True

    def __init__(self, state_file: str, socket_path: str) -> None:
        self.library = SimulatedNvmlLibrary(state_file)
        self.lock = threading.Lock()
        self.socket_path = socket_path
        staging = f"{socket_path}.{os.getpid()}.tmp"
        if os.path.exists(staging):
            os.unlink(staging)
        super().__init__(staging, _Connection)
        # What clients of an earlier server on this socket held went with their connections.
        with contextlib.suppress(FileNotFoundError):  # no node yet: nothing is held
            self.library.release_holds(self.held_via)
        os.replace(staging, socket_path)

    @property
    def held_via(self) -> str:
        """The mark of the processes this server's clients hold (SimProcess.held_via)."""
        return os.path.abspath(self.socket_path)

    def server_close(self) -> None:
        super().server_close()
        if os.path.exists(self.socket_path):
            os.unlink(self.socket_path)

    def call(self, name: str, payload: bytes, client: _Client) -> bytes:
        """The reply body (code and outs) of one request of ``client``'s connection."""
        with self.lock:
            try:
                code, outs = self._call(name, payload, client)
            except SimulatedNvmlMisuse as exc:
                print(f"migsim.nvml.server: {name}: {exc}", file=sys.stderr)
                code, outs = st.INVALID_ARGUMENT, b""
        return struct.pack("=i", code) + outs

    def _call(self, name: str, payload: bytes, client: _Client) -> tuple[int, bytes]:
        lib = self.library
        if name in _INIT_FUNCTIONS:
            r = _Reader(payload)
            args = [r.unpack("I")] if name == "nvmlInitWithFlags" else []
            view = _visibility(r)
            if r.pos != len(payload):
                raise SimulatedNvmlMisuse(f"request longer than the parameters of {name}")
            code = lib.call(name, *args)
            if code == st.SUCCESS:
                client.inits += 1
                client.view = view
            return code, b""
        if name == "nvmlShutdown":
            if not client.inits:
                return st.UNINITIALIZED, b""
            client.inits -= 1
            return lib.call("nvmlShutdown"), b""
        if name == abi.POLL_EVENTS:
            return self._poll_events(payload, client)
        if name == abi.RESET_GPU:
            return self._reset_gpu(payload, client)
        if name == abi.HOLD_DEVICES:
            return self._hold_devices(payload, client)
        fn = abi.BY_NAME.get(name)
        if fn is None:
            return st.FUNCTION_NOT_FOUND, b""
        reader = _Reader(payload)
        args, replies = _decode(fn, reader)
        if reader.pos != len(payload):
            raise SimulatedNvmlMisuse(f"request longer than the parameters of {name}")
        code = lib.call(fn.server_name, *args, view=client.view)
        return code, b"".join(reply(code) for reply in replies)

    def _reset_gpu(self, payload: bytes, client: _Client) -> tuple[int, bytes]:
        if not client.inits:
            return st.UNINITIALIZED, b""
        r = _Reader(payload)
        token = r.unpack("Q")
        if r.pos != len(payload):
            raise SimulatedNvmlMisuse(f"request longer than the parameters of {abi.RESET_GPU}")
        code, why = self.library.reset_device(ctypes.c_void_p(token) if token else None)
        return code, _counted(why.encode(), 1)

    def _hold_devices(self, payload: bytes, client: _Client) -> tuple[int, bytes]:
        none = _counted(b"", 1)
        if not client.inits:
            return st.UNINITIALIZED, none
        r = _Reader(payload)
        memory = r.unpack("I")
        name = r.take(r.unpack("I")).decode(errors="replace")
        if r.pos != len(payload):
            raise SimulatedNvmlMisuse(f"request longer than the parameters of {abi.HOLD_DEVICES}")
        if client.pid <= 0:
            return st.NOT_SUPPORTED, none  # no peer pid: nothing NVML could report
        code, uuids = self.library.hold_devices(
            client.view, client.pid, memory, name, self.held_via
        )
        client.holding = client.holding or code == st.SUCCESS
        return code, _counted("".join(f"{u}\n" for u in uuids).encode(), 1)

    def _poll_events(self, payload: bytes, client: _Client) -> tuple[int, bytes]:
        if not client.inits:
            return st.UNINITIALIZED, b""
        r = _Reader(payload)
        cursor = r.unpack("Q")
        registrations = []
        for _ in range(r.unpack("I")):
            token = r.unpack("Q")
            registrations.append((ctypes.c_void_p(token) if token else None, r.unpack("Q")))
        if r.pos != len(payload):
            raise SimulatedNvmlMisuse(f"request longer than the parameters of {abi.POLL_EVENTS}")
        try:
            after, event, gpu = self.library.poll_events(
                None if cursor == _LATEST_ONLY else cursor, registrations
            )
        except st.Refused as refused:
            return refused.code, b""
        if event is None:
            return st.SUCCESS, struct.pack("=QB", after, 0)
        return st.SUCCESS, struct.pack(
            "=QBQQQII", after, 1, gpu, event.event_type, event.data, event.gi, event.ci
        )

    def disconnected(self, client: _Client) -> None:
        with self.lock:
            for _ in range(client.inits):
                self.library.call("nvmlShutdown")
            if client.holding:
                self.library.release_holds(self.held_via, client.pid)


class _Connection(socketserver.BaseRequestHandler):
    server: NvmlServer

    def handle(self) -> None:
        sock: socket.socket = self.request
        client = _Client(pid=_peer_pid(sock))
        try:
            while True:
                head = _recv(sock, 4)
                if head is None:
                    return
                body = _recv(sock, struct.unpack("=I", head)[0])
                if body is None:
                    return
                name, _, payload = body.partition(b"\0")
                try:
                    reply = self.server.call(name.decode(), payload, client)
                except Exception:  # a bug here must not kill the node's other clients
                    traceback.print_exc()
                    reply = struct.pack("=i", st.UNKNOWN)
                sock.sendall(struct.pack("=I", len(reply)) + reply)
        except OSError:
            return
        finally:
            self.server.disconnected(client)


def _peer_pid(sock: socket.socket) -> int:
    """The connecting process's pid in this server's pid namespace (0 if unknown)."""
    try:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except (OSError, AttributeError):
        return 0
    pid: int = struct.unpack("3i", creds)[0]
    return pid


def _recv(sock: socket.socket, n: int) -> bytes | None:
    chunks, left = [], n
    while left:
        chunk = sock.recv(left)
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m migsim.nvml.server", description=__doc__)
    p.add_argument(
        "--state",
        default=os.environ.get(st.ENV_STATE),
        help=f"node state file (default: ${st.ENV_STATE})",
    )
    p.add_argument(
        "--socket",
        default=os.environ.get(abi.ENV_SOCKET),
        help=f"unix socket to serve (default: ${abi.ENV_SOCKET})",
    )
    args = p.parse_args(argv)
    if not args.state or not args.socket:
        p.error("--state and --socket are needed")
    server = NvmlServer(args.state, args.socket)

    def stop(_sig: int, _frame: FrameType | None) -> None:
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
