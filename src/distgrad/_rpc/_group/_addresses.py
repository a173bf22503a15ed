"""Which local address a worker publishes for TCP: one its peers on other hosts can reach.

The rule (``listen_host``): an explicit ``listen_addr`` / ``$DISTGRAD_LISTEN_ADDR`` wins. A
rendezvous host written as loopback (``localhost``, ``127.0.0.1``, ``::1``) means a one-host
group: loopback. A rendezvous host that is *a name resolving to loopback here* is this host's
own name (Debian-style ``/etc/hosts`` maps it to ``127.0.1.1``; torchrun hands the master node
its own hostname): the group may span hosts, so the worker publishes this host's primary
address (:func:`primary_address`). Any other rendezvous host: the local address the kernel
routes to it from (no packet is sent), so a multi-homed host picks the interface toward the
rendezvous, not a Docker bridge.
"""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import socket
import struct

__all__ = ["listen_host_for", "primary_address"]

_log = logging.getLogger("distgrad.rpc")

_SIOCGIFADDR = 0x8915
_SIOCGIFFLAGS = 0x8913
_IFF_UP = 0x1
_IFF_LOOPBACK = 0x8
# interfaces of containers, VMs and overlays: never the host's own address
_VIRTUAL_PREFIXES = (
    "docker",
    "br-",
    "veth",
    "virbr",
    "cni",
    "flannel",
    "cali",
    "vxlan",
    "tun",
    "tap",
)
_LITERAL_LOOPBACK = ("localhost", "localhost.localdomain", "ip6-localhost")


def _interface_ipv4(name: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("256s", name.encode()[:15])
        try:
            flags = struct.unpack("H", fcntl.ioctl(sock.fileno(), _SIOCGIFFLAGS, request)[16:18])[0]
            if not flags & _IFF_UP or flags & _IFF_LOOPBACK:
                return None
            answer = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, request)
        except OSError:
            return None  # down, or no IPv4 address
    return socket.inet_ntoa(answer[20:24])


def _default_route_interface() -> str | None:
    try:
        with open("/proc/net/route") as routes:
            next(routes, None)
            for line in routes:
                fields = line.split()
                if len(fields) > 2 and fields[1] == "00000000":
                    return fields[0]
    except OSError:
        pass
    return None


def primary_address() -> str | None:
    """This host's primary IPv4 address: that of the default route's interface, else of the
    first interface that is up, not loopback and not a container/VM bridge; None if none."""
    default = _default_route_interface()
    if default is not None:
        address = _interface_ipv4(default)
        if address is not None:
            return address
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    for name in names:
        if name.startswith(_VIRTUAL_PREFIXES):
            continue
        address = _interface_ipv4(name)
        if address is not None:
            return address
    return None


def _resolves_to_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def _written_as_loopback(host: str) -> bool:
    if host.lower() in _LITERAL_LOOPBACK:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def listen_host_for(master: str | None) -> str:
    """The address to publish for a rendezvous at ``master`` (see the module's rule)."""
    if not master or _written_as_loopback(master):
        return "127.0.0.1"
    if _resolves_to_loopback(master):  # this host's own name: the group may span hosts
        address = primary_address()
        if address is None:
            _log.warning(
                "rendezvous host %r is this host, and no non-loopback address was found: "
                "listening on 127.0.0.1 (peers on other hosts cannot reach this worker; "
                "set listen_addr or DISTGRAD_LISTEN_ADDR)",
                master,
            )
            return "127.0.0.1"
        return address
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((socket.gethostbyname(master), 9))  # a route lookup: nothing is sent
            return str(probe.getsockname()[0])
    except OSError:
        return "127.0.0.1"
