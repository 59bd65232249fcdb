"""Entry point run inside a fresh network namespace (`unshare --net`): bring up loopback, check it
is the only interface, then exec torchrun with the given arguments.

torchrun's TCPStore and gloo may bind every interface; in this namespace the only one is `lo`,
so the processes can reach 127.0.0.1 and nothing else. Needs no `ip` binary: one ioctl.
"""

from __future__ import annotations

import fcntl
import os
import socket
import struct
import sys

SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
IFREQ = "16sH22x"  # struct ifreq: name, then flags in a 24-byte union


def loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        flags = struct.unpack(IFREQ, fcntl.ioctl(s, SIOCGIFFLAGS, struct.pack(IFREQ, b"lo", 0)))[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack(IFREQ, b"lo", flags | IFF_UP))


def main() -> None:
    interfaces = sorted(name for _, name in socket.if_nameindex())
    if interfaces != ["lo"]:
        sys.exit(f"refusing to launch: this network namespace has interfaces {interfaces}, expected only "
                 "'lo' (run under `unshare --net`)")
    loopback_up()
    os.execv(sys.executable, [sys.executable, "-m", "torch.distributed.run", *sys.argv[1:]])


if __name__ == "__main__":
    main()
