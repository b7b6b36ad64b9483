"""The one address policy for every URL the network itself calls: a team's bucket endpoint (the
scanner and the runners' staging read it), a team's webhooks (the notification worker POSTs
to them) and a team's experiment tracker (tracking.worker sends its jobs' runs there), and
anything added later.

Left open, a team could point them at internal addresses (the database, the network's own
metrics, a cloud's metadata service, a runner's neighbours) and learn from the answers, errors
or delivery log what is there. So such a URL must be at a public address, unless the network's
operators allow its host or network in the allow-list of its purpose (PURPOSES: a MinIO of
their own in E31_S3_ENDPOINT_ALLOW, an internal receiver in E31_WEBHOOK_ALLOW, an internal
MLflow server in E31_TRACKER_ALLOW). The lists are kept apart: allowing the operators' MinIO
as a bucket endpoint does not let a team's webhook POST to it.

The decision (refusal) is a pure function of the host, the addresses it resolves to and the
allow-list; check_url resolves the host and applies it. It is asked when a URL is saved and
again before every use, since DNS may change between them. PinnedTransport goes one step
further for HTTP: it resolves once, checks, and connects to the address it checked, so a name
cannot answer the check with a public address and the connection with an internal one;
pin_boto3 does the same for every connection a boto3 client opens to a team's bucket.
"""

import ipaddress
import socket
from typing import NamedTuple
from urllib.parse import urlsplit


class Purpose(NamedTuple):
    setting: str  # the allow-list's setting
    subject: str  # how a refusal names the URL
    rule: str  # and what it says the URL must be


PURPOSES = {
    "s3": Purpose("E31_S3_ENDPOINT_ALLOW", "the endpoint", "a bucket's endpoint must be at a public address"),
    "webhook": Purpose("E31_WEBHOOK_ALLOW", "the webhook", "a webhook must be at a public address"),
    "tracker": Purpose("E31_TRACKER_ALLOW", "the tracker", "an experiment tracker must be at a public address"),
}


class Refused(Exception):
    """A call to an address the policy refuses; str() is the reason."""


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


NAT64 = ipaddress.ip_network("64:ff9b::/96")


def _unwrapped(address):
    """An IPv4 address given in IPv6 clothing is judged as the IPv4 address: mapped
    (::ffff:10.0.0.1), 6to4 (2002:0a00:0001::) and NAT64 (64:ff9b::10.0.0.1)."""
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return address.ipv4_mapped
        if address.sixtofour is not None:
            return address.sixtofour
        if address in NAT64:
            return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
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


def _host(host):
    return (host or "").strip().lower().strip("[]").rstrip(".")


def refusal(host, addresses, allow=(), purpose="s3"):
    """None if a URL at host, resolving to addresses, may be called; else the reason, as the end
    of a sentence. allow: the allow-list's entries (see parse_allow_list)."""
    subject, rule = PURPOSES[purpose][1:]
    hosts, networks = parse_allow_list(allow)
    host = _host(host)
    if not host:
        return f"{subject} has no host"
    if host in hosts:
        return None
    if not addresses:
        return f"{subject}'s host {host} cannot be found (no address)"
    for address in addresses:
        ip = _unwrapped(ipaddress.ip_address(address))
        kind = kind_of(ip)
        if kind is None or any(ip in network for network in networks if network.version == ip.version):
            continue
        shown = host if host == str(ip) else f"{host} ({ip})"
        article = "an" if kind[0] in "aeiou" else "a"
        return f"{subject} {shown} is at {article} {kind} address; {rule}"
    return None


def split_endpoint(url, purpose="s3"):
    """(host, port, None) for a URL of a usable form, (None, None, reason) for one that is not;
    (None, None, None) for a blank one (for a bucket: AWS's default endpoint)."""
    subject = PURPOSES[purpose].subject
    url = (url or "").strip()
    if not url:
        return None, None, None
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return None, None, f"{subject} is not a valid URL"
    if parts.scheme not in ("http", "https"):
        return None, None, f"{subject} must be an http:// or https:// address"
    if not parts.hostname:
        return None, None, f"{subject} has no host"
    return parts.hostname, port or (443 if parts.scheme == "https" else 80), None


def resolve(host, port):
    """Every address host resolves to ([] if it resolves to none)."""
    try:
        infos = socket.getaddrinfo(host, port, proto=socket.IPPROTO_TCP)
    except (socket.gaierror, UnicodeError, OSError):
        return []
    return sorted({info[4][0].split("%", 1)[0] for info in infos})


def allow_list(purpose, allow=None):
    """allow, or the purpose's allow-list setting when it is None."""
    setting = PURPOSES[purpose].setting
    if allow is not None:
        return allow
    from django.conf import (
        settings,  # here: settings import this module (parse_allow_list)
    )

    return getattr(settings, setting, [])


def connectable(host, port, purpose, allow=None):
    """The addresses a call to host may connect to: every address it resolves to, all allowed
    (an address literal is its own); None when the allow-list names the host (connect as usual,
    no need to ask DNS). Raises Refused with the reason."""
    allow = allow_list(purpose, allow)
    hosts, _ = parse_allow_list(allow)
    if _host(host) in hosts:
        return None
    try:
        addresses = [str(ipaddress.ip_address(_host(host)))]
    except ValueError:
        addresses = resolve(host, port)
    if reason := refusal(host, addresses, allow, purpose):
        raise Refused(reason)
    return addresses


def check_url(url, purpose, allow=None):
    """None if the network may call url for purpose (see PURPOSES; a blank url: None), else the
    reason. allow: the allow-list (default: the purpose's setting)."""
    host, port, reason = split_endpoint(url, purpose)
    if reason or host is None:
        return reason
    try:
        connectable(host, port, purpose, allow)
    except Refused as refused:
        return str(refused)
    return None


def check_endpoint(url, allow=None):
    """None if a registered bucket may be read at url (blank: AWS's default endpoint), else the
    reason. allow: the allow-list (default: settings.E31_S3_ENDPOINT_ALLOW)."""
    return check_url(url, "s3", allow)


class PinnedTransport:
    """An httpx transport that calls only what the policy allows, at the address it checked:
    each request's host is resolved once, every address checked, and the connection made to a
    checked address, with the URL's host kept in the Host header and as the TLS server name (so
    the certificate is still verified for it). Raises Refused for a refused host.

    Use it in a client with trust_env=False (an HTTP_PROXY from the environment would connect by
    name, around the check) and follow_redirects=False (a redirect is the caller's to record).
    httpx is imported when one is made, not with this module, which settings import."""

    def __init__(self, purpose, allow=None, **options):
        import httpx

        self.purpose, self.allow, self.httpx = purpose, allow, httpx
        # No kept-alive connections: a pool keys them by address, so a second host at the same
        # address would reuse a TLS session verified for the first.
        limits = httpx.Limits(max_keepalive_connections=0)
        self.inner = httpx.HTTPTransport(limits=limits, **options)

    def handle_request(self, request):
        url = request.url
        host = url.raw_host.decode("ascii")
        port = url.port or (443 if url.scheme == "https" else 80)
        addresses = connectable(host, port, self.purpose, self.allow)
        if addresses is None:
            return self.inner.handle_request(request)  # allowed by name: the operators' own host
        error = None
        for address in addresses:
            pinned = self.httpx.Request(
                request.method,
                url.copy_with(host=address),
                headers=request.headers,
                stream=request.stream,
                extensions={**request.extensions, "sni_hostname": host},
            )
            try:
                return self.inner.handle_request(pinned)
            except self.httpx.ConnectError as failed:
                error = failed  # the next address of the host, as a resolver's caller would
        raise error

    def close(self):
        self.inner.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()


def pin_boto3(client, purpose, allow=None):
    """client (a boto3 client), made to open each connection only where the policy allows, at
    the address it checked (the URL's host stays the TLS name, so the certificate is verified for
    it): a client kept for hours cannot be led to an internal address by its endpoint's DNS
    changing. A refused host fails the request (botocore's HTTPClientError, the reason inside).

    Make the client with Config(proxies={}): a proxy from the environment would connect by name."""
    from botocore.awsrequest import AWSHTTPConnectionPool, AWSHTTPSConnectionPool

    manager = client._endpoint.http_session._manager
    manager.clear()
    manager.pool_classes_by_scheme = {
        "http": _pinned_pool(AWSHTTPConnectionPool, purpose, allow),
        "https": _pinned_pool(AWSHTTPSConnectionPool, purpose, allow),
    }
    return client


def _pinned_pool(pool_class, purpose, allow):
    from urllib3.exceptions import ConnectTimeoutError

    class PinnedConnection(pool_class.ConnectionCls):
        def _new_conn(self):
            addresses = connectable(self._dns_host, self.port, purpose, allow)
            if addresses is None:
                return super()._new_conn()  # allowed by name: the operators' own host
            name, error = self._dns_host, None
            for address in addresses:
                # urllib3 connects to _dns_host; the name stays for Host, SNI and the certificate.
                self._dns_host = address
                try:
                    return super()._new_conn()
                except ConnectTimeoutError as failed:  # NewConnectionError too
                    error = failed
                finally:
                    self._dns_host = name
            raise error

    return type(f"Pinned{pool_class.__name__}", (pool_class,), {"ConnectionCls": PinnedConnection})
