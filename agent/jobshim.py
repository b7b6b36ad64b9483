"""Started between the runner and a job, as `python -I -S jobshim.py <runner pid> <spec> command...`.

It does, with the runner's privileges, only what bubblewrap cannot, then becomes bwrap (or, with
isolation off, the command): join the job's cgroups (before anything of the job runs, so nothing
escapes them); set its resource limits; for a job given the network, make it a network namespace
of its own, loopback up, with unreachable routes to the node's own addresses and the networks the
operator denies; where the job's uid could not pass a folder on the way to what the sandbox binds
(Python under /root), cover that folder with an empty tmpfs in a private mount namespace and bind
those paths back; drop to the job's uid and gid with no supplementary groups; ask the kernel to
kill it when the runner dies (after the uid change, which would clear that); exec
`bwrap --args FD -- command`, the sandbox's whole description and the job's environment read from
FD. Every value in the spec is the runner's own: paths it made, numbers it chose. The shim's
environment is the runner's fixed minimum, never the job's. Any step that fails ends it with code
126 and one line on stderr: a job never runs less isolated than asked. The standard library only
(no site packages, no Django).
"""

import ctypes
import json
import os
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWNET = 0x40000000
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
MS_NOSUID, MS_NODEV, MS_BIND, MS_REC, MS_PRIVATE = 2, 4, 4096, 16384, 1 << 18


def fail(what, error):
    sys.stderr.write(f"e31: could not isolate the job ({what}): {error}\n")
    sys.stderr.flush()
    os._exit(126)


def main(argv):
    parent, spec, command = int(argv[1]), json.loads(argv[2]), argv[3:]
    libc = ctypes.CDLL(None, use_errno=True)

    def call(result, what):
        if result != 0:
            fail(what, os.strerror(ctypes.get_errno()))

    for folder in spec.get("cgroups", ()):
        try:
            with open(os.path.join(folder, "cgroup.procs"), "w") as procs:
                procs.write(str(os.getpid()))
        except OSError as error:
            fail(f"joining the cgroup {folder}", error)
    if spec.get("rlimits"):
        import resource

        for name, (soft, hard) in spec["rlimits"].items():
            try:
                resource.setrlimit(getattr(resource, name), (soft, hard))
            except (OSError, ValueError) as error:
                fail(f"setting {name}", error)
    if spec.get("netns"):
        # A network of its own for a job that asked for the network: its own loopback, and an
        # uplink the runner adds from outside (slirp4netns), so the node's own services on
        # 127.0.0.1 are never its neighbours. Made here, by root, so the runner can join it.
        call(libc.unshare(CLONE_NEWNET), "unshare")
        loopback_up()
        # The node's own addresses and the networks the operator keeps from jobs (the clouds'
        # metadata service among them) are unreachable routes: the uplink connects as root on
        # the node, so it must never be handed a packet for them. The namespace is the node's
        # user namespace's, so the job (root only in its own) cannot remove them.
        for network in spec.get("deny", ()):
            refuse_route(network)
    if spec.get("covers"):
        call(libc.unshare(CLONE_NEWNS), "unshare")
        call(libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "making the mounts private")
        for folder, mode, keep in spec["covers"]:
            cover(libc, call, folder, mode, keep)
    uid = spec.get("uid")
    if uid is not None:
        gid = spec.get("gid", uid)
        try:
            os.setgroups([])
            os.setresgid(gid, gid, gid)
            os.setresuid(uid, uid, uid)
        except OSError as error:
            fail(f"becoming uid {uid}", error)
    try:
        os.chdir(spec["cwd"] if not spec.get("bwrap") else "/")
    except (OSError, KeyError) as error:
        fail("entering the job's folder", error)
    try:
        libc.prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
    except Exception:  # noqa: BLE001
        pass
    if os.getppid() != parent:  # the runner died before the line above
        os._exit(137)
    if spec.get("bwrap"):
        for fd in spec.get("pass_fds", ()):
            os.set_inheritable(fd, True)
        os.set_inheritable(spec["args_fd"], True)
        command = [spec["bwrap"], "--args", str(spec["args_fd"]), "--", *command]
    try:
        os.execv(command[0], command)
    except OSError as error:
        fail(f"running {command[0]}", error)


def loopback_up():
    """ip link set lo up, in the new network namespace."""
    import fcntl
    import socket
    import struct

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            request = struct.pack("16sh14x", b"lo", 0)
            flags = struct.unpack("16sh14x", fcntl.ioctl(s, SIOCGIFFLAGS, request))[1]
            fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sh14x", b"lo", flags | IFF_UP))
    except OSError as error:
        fail("bringing the loopback up", error)


def refuse_route(network):
    """ip route add unreachable NETWORK, through rtnetlink (RTM_NEWROUTE)."""
    import socket
    import struct

    address, length = network.split("/")
    # struct rtmsg: family, dst_len, src_len, tos, table (main), protocol (static), scope
    # (universe), type (unreachable), flags; then the destination attribute (RTA_DST).
    body = struct.pack("=BBBBBBBBI", socket.AF_INET, int(length), 0, 0, 254, 4, 0, 7, 0)
    body += struct.pack("=HH", 8, 1) + socket.inet_aton(address)
    flags = 0x1 | 0x4 | 0x200 | 0x400  # NLM_F_REQUEST | NLM_F_ACK | NLM_F_EXCL | NLM_F_CREATE
    header = struct.pack("=IHHII", 16 + len(body), 24, flags, 1, 0)  # RTM_NEWROUTE
    try:
        with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE) as s:
            s.bind((0, 0))
            s.send(header + body)
            reply = s.recv(4096)
    except OSError as error:
        fail(f"refusing {network}", error)
    kind = struct.unpack("=IH", reply[:6])[1]
    error = struct.unpack("=i", reply[16:20])[0] if kind == 2 else 0  # NLMSG_ERROR: 0 is the ack
    if error:
        fail(f"refusing {network}", os.strerror(-error))


def cover(libc, call, folder, mode, keep):
    """An empty tmpfs over folder, and each kept path under it bound back in place."""
    held = []
    for path in keep:  # opened before they are covered
        try:
            held.append((path, os.open(path, os.O_PATH)))
        except OSError as error:
            fail(f"opening {path}", error)
    options = f"mode={mode:o},size=1m"
    call(libc.mount(b"tmpfs", folder.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, options.encode()), f"covering {folder}")
    for path, fd in held:
        source = f"/proc/self/fd/{fd}"
        try:
            if os.path.isdir(source):
                os.makedirs(path, exist_ok=True)
            else:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                open(path, "a").close()
        except OSError as error:
            fail(f"making {path}", error)
        call(libc.mount(source.encode(), path.encode(), None, MS_BIND | MS_REC, None), f"binding {path}")
        os.close(fd)


if __name__ == "__main__":
    main(sys.argv)
