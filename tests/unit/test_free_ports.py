"""We test the local cluster's choice of ports for its servers: each is free when chosen, they
are distinct, and none lies in the kernel's ephemeral range, where an outgoing connection may hold
it by the time the server binds (a fault test's agent once crashed for two minutes on a port
taken that way)."""

from __future__ import annotations

import socket

from migsim.cluster.processes import ephemeral_range, free_ports


def test_ports_lie_below_the_ephemeral_range_and_are_distinct() -> None:
    low, _ = ephemeral_range()
    ports = [p for _ in range(50) for p in free_ports(4)]
    assert all(1024 < p < low for p in ports), sorted(p for p in ports if p >= low)[:5]
    for _ in range(50):
        assert len(set(free_ports(8))) == 8


def test_a_port_in_use_is_never_chosen() -> None:
    held = []
    try:
        for _ in range(200):  # hold many, so that a draw would hit one if it did not check
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", free_ports(1)[0]))
            s.listen()
            held.append(s)
        taken = {s.getsockname()[1] for s in held}
        assert not taken & set(free_ports(200))
    finally:
        for s in held:
            s.close()


def test_the_range_read_from_the_kernel() -> None:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low, high = (int(x) for x in f.read().split())
    assert ephemeral_range() == (low, high)
