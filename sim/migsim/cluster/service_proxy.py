"""The `kubernetes` Service for the real node's pods, where kube-proxy would give it: a TCP
forwarder from the Service's ClusterIP and port (10.96.0.1:443, the address added to the loopback
interface) to the local API server. In-cluster clients -- the agent's pod, which reads
KUBERNETES_SERVICE_HOST and _PORT as the kubelet sets them -- reach the API server through it.

``python -m migsim.cluster.service_proxy --listen HOST:PORT --to HOST:PORT``
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
from collections.abc import Sequence


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while chunk := await reader.read(65536):
            writer.write(chunk)
            await writer.drain()
    except (ConnectionError, asyncio.CancelledError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()


async def _serve(listen: tuple[str, int], target: tuple[str, int]) -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*target)
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))

    server = await asyncio.start_server(handle, *listen)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m migsim.cluster.service_proxy", description=__doc__)
    p.add_argument("--listen", required=True, type=_address)
    p.add_argument("--to", required=True, type=_address)
    args = p.parse_args(argv)
    asyncio.run(_serve(args.listen, args.to))
    return 0


if __name__ == "__main__":
    sys.exit(main())
