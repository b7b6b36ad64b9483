"""Which endpoints a team's registered bucket may be at.

The scanner (in the scheduler) and the runners' staging connect to the endpoint a team gives,
from inside the network. Left open, a team could point them at internal addresses (the
database, a metadata service, a runner's neighbours) and learn from the answers or errors what
is there. So an endpoint must be at a public address, unless the network's operators allow its
host or network in E31_S3_ENDPOINT_ALLOW (a MinIO of their own, a test server on loopback).

The decision (refusal) is a pure function of the host, the addresses it resolves to and the
allow-list; check_endpoint resolves the host and applies it. It is asked at registration, at a
change of credentials, before every scan and when a runner makes its client: DNS may change
between them.
"""

import ipaddress
import socket
from urllib.parse import urlsplit


def parse_allow_list(entries):
    """The allow-list's entries as (host names, networks): "minio.internal", "10.1.0.0/16",
    "127.0.0.1", "::1". Raises ValueError for an entry that is neither."""
    hosts, networks = set(), []
    for entry in entries or ():
        if not isinstance(entry, str):
            networks.append(ipaddress.ip_network(entry))  # already an address or network
            continue
        text = entry.strip().lower().strip("[]")
        try:
            networks.append(ipaddress.ip_network(text, strict=False))
            continue
        except ValueError:
            pass
        name = text.rstrip(".")
        if not name or "/" in name or not all(part and all(c.isalnum() or c in "-_" for c in part) for part in name.split(".")):
            raise ValueError(f"{entry!r} is neither a host name nor an address or network (like 10.1.0.0/16)")
        hosts.add(name)
    return hosts, networks


def _unwrapped(address):
    """An IPv4 address given in IPv6 clothing (::ffff:10.0.0.1) is judged as the IPv4 address."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def kind_of(address):
    """Why an address is not public ("loopback", "private", ...), or None for a public one."""
    address = _unwrapped(ipaddress.ip_address(address))
    for kind, test in (
        ("unspecified", address.is_unspecified),
        ("loopback", address.is_loopback),
        ("link-local", address.is_link_local),
        ("multicast", address.is_multicast),
        ("reserved", address.is_reserved),
        ("private", address.is_private),
    ):
        if test:
            return kind
    # Shared (100.64.0.0/10), documentation and other special ranges: not reachable as public.
    return None if address.is_global else "non-public"


def refusal(host, addresses, allow=()):
    """None if an endpoint at host, resolving to addresses, may be used; else the reason, as
    the end of a sentence. allow: the allow-list's entries (see parse_allow_list)."""
    hosts, networks = parse_allow_list(allow)
    host = (host or "").strip().lower().strip("[]").rstrip(".")
    if not host:
        return "the endpoint has no host"
    if host in hosts:
        return None
    if not addresses:
        return f"the endpoint's host {host} cannot be found (no address)"
    for address in addresses:
        ip = _unwrapped(ipaddress.ip_address(address))
        kind = kind_of(ip)
        if kind is None or any(ip in network for network in networks if network.version == ip.version):
            continue
        shown = host if host == str(ip) else f"{host} ({ip})"
        article = "an" if kind[0] in "aeiou" else "a"
        return f"the endpoint {shown} is at {article} {kind} address; a bucket's endpoint must be at a public address"
    return None


def split_endpoint(url):
    """(host, port, None) for an endpoint URL of a usable form, (None, None, reason) for one that
    is not; (None, None, None) for a blank one (AWS's default endpoint)."""
    url = (url or "").strip()
    if not url:
        return None, None, None
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return None, None, "the endpoint is not a valid URL"
    if parts.scheme not in ("http", "https"):
        return None, None, "the endpoint must be an http:// or https:// address"
    if not parts.hostname:
        return None, None, "the endpoint has no host"
    return parts.hostname, port or (443 if parts.scheme == "https" else 80), None


def resolve(host, port):
    """Every address host resolves to ([] if it resolves to none)."""
    try:
        infos = socket.getaddrinfo(host, port, proto=socket.IPPROTO_TCP)
    except (socket.gaierror, UnicodeError, OSError):
        return []
    return sorted({info[4][0].split("%", 1)[0] for info in infos})


def check_endpoint(url, allow=None):
    """None if a registered bucket may be read at url (blank: AWS's default endpoint), else the
    reason. allow: the allow-list (default: settings.E31_S3_ENDPOINT_ALLOW)."""
    host, port, reason = split_endpoint(url)
    if reason or host is None:
        return reason
    if allow is None:
        from django.conf import settings

        allow = getattr(settings, "E31_S3_ENDPOINT_ALLOW", [])
    hosts, _ = parse_allow_list(allow)
    if host.lower().rstrip(".") in hosts:
        return None  # allowed by name: no need to ask DNS
    try:
        addresses = [str(ipaddress.ip_address(host.strip("[]")))]
    except ValueError:
        addresses = resolve(host, port)
    return refusal(host, addresses, allow)
