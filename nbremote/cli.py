"""The ``nbremote`` command: ``nbremote demo`` (the main job) and ``nbremote worker``.

``nbremote demo`` shows what nbremote is for: it starts local worker kernels, trains a model split across
them and this process, prints the loss falling and each worker's parameters, and shuts down leaving no
process behind (``--tour`` runs the RPC layer's tour instead). The demos themselves live in
:mod:`nbremote._demo`. ``nbremote worker`` starts a kernel that a notebook elsewhere can attach to with
``nbremote.AttachedKernel``; ``--ip auto --driver ADDR`` listens on this host's own address on its route back
to the notebook's machine, so no one types a node's address (a Slurm job does not know it before it runs).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import socket
import sys
from collections.abc import Sequence

from nbremote._netaddr import is_loopback, source_address

DEMO_HELP = """\
Start local worker kernels, build a small model split across them (its first layer stays in this process,
one stage per worker), train it for a few steps with distributed autograd and DistributedOptimizer,
printing the loss as it falls and each worker's parameters (what the notebook's module panel shows), then
shut down and check that no worker process is left. Exits with 1 if the loss did not fall or a worker
process outlived the shutdown.
"""

WORKER_HELP = """\
Run an ipykernel kernel in the foreground and write its connection file. Copy that file to the notebook's
machine and attach the kernel as a worker: nbremote.AttachedKernel("kernel.json"), or, from another
machine, AttachedKernel("kernel.json", ssh="user@this-host"). The kernel listens on --ip (loopback by
default: reach it through SSH). On any other address its channels are encrypted with CurveZMQ: the keys
are written into the connection file (0600), the kernel refuses clients without them, and
AttachedKernel uses them; --no-encrypt drops the encryption, for a network you trust (messages stay
signed, their buffers digested). --ip auto --driver ADDR: this host's address on its route to ADDR (the
notebook's machine), as `ip route get ADDR` gives it -- what a batch job on a node it does not know yet needs.
"""


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def own_address(driver: str) -> str:
    """This host's source address on its route to ``driver`` (``_netaddr.source_address``), or a ``ValueError``
    naming the option to fix."""
    try:
        return source_address(driver)
    except socket.gaierror as exc:
        raise ValueError(f"--driver {driver}: not an address this host can resolve ({exc})") from None
    except OSError as exc:
        raise ValueError(f"--ip auto: this host has no route to the driver at {driver} ({exc.strerror})") from None


def check_ip(ip: str, driver: str | None) -> str | None:
    """Why a kernel listening on ``ip`` could not be reached by the driver at ``driver`` (None: it can be, as far as
    this host can tell). A kernel writes the address it listens on into its connection file, and an address the
    driver cannot reach ends in a handshake timeout that names no address (issue 39), so say it here."""
    where = driver or "<the notebook machine's address>"
    fix = f"use --ip auto --driver {where} or one of this host's own addresses"
    if ip in ("0.0.0.0", "::", ""):
        return (f"--ip {ip or repr(ip)} listens on every address, but the connection file must name one the notebook "
                f"can connect to; {fix}")
    if driver and is_loopback(ip) and not is_loopback(driver):
        return (f"--ip {ip} is a loopback address, which the driver at {driver} (another machine) cannot reach "
                f"(a Debian-style node maps its own name to 127.0.1.1: `hostname -i` gives that); {fix}")
    try:
        infos = socket.getaddrinfo(ip, 0, type=socket.SOCK_STREAM)
        with socket.socket(infos[0][0], socket.SOCK_STREAM) as s:
            s.bind(infos[0][4])
    except OSError as exc:
        return f"--ip {ip}: this host cannot listen on that address ({exc.strerror or exc}); {fix}"
    return None


def worker(connection_file: str, ip: str, encrypt: bool = True, driver: str | None = None) -> int:
    """Run an ipykernel in the foreground, writing ``connection_file`` for ``AttachedKernel``.

    Beyond loopback (unless ``encrypt`` is False) the connection file is written here first, fresh, with a
    CurveZMQ keypair: ipykernel (>= 7.4) loads it, binds its channels as CurveZMQ servers -- which refuse
    clients that do not hold the key -- and fills in the ports it bound. A Jupyter kernel otherwise signs
    its messages but sends them in clear text (a payload was read off the wire from another network
    namespace, issue 22).
    """
    import zmq

    try:
        if ip == "auto":
            if not driver:
                raise ValueError("--ip auto needs --driver ADDR, the address of the notebook's machine, to find this "
                                 "host's own address on its route there")
            ip = own_address(driver)
            print(f"nbremote worker: --ip auto: listening on {ip}, this host's address on its route to {driver}",
                  flush=True)
        problem = check_ip(ip, driver)
    except ValueError as exc:
        problem = str(exc)
    if problem:
        print(f"nbremote worker: {problem}", file=sys.stderr, flush=True)
        return 2
    if not is_loopback(ip):
        if not encrypt:
            print(f"nbremote worker: WARNING: listening on {ip} without encryption (--no-encrypt): anyone on that "
                  "network can read what the kernel sends and receives; use it on a network you trust only",
                  file=sys.stderr, flush=True)
        elif not zmq.has("curve"):
            print("nbremote worker: this pyzmq's libzmq has no CurveZMQ, so a kernel beyond loopback cannot be "
                  "encrypted: listen on 127.0.0.1 and attach through SSH (AttachedKernel(..., ssh=...)), or pass "
                  "--no-encrypt on a network you trust", file=sys.stderr, flush=True)
            return 2
        else:
            from jupyter_client.connect import write_connection_file

            public, secret = zmq.curve_keypair()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(connection_file)  # an old file's ports and key would be loaded instead
            write_connection_file(connection_file, ip=ip, key=secrets.token_hex(32).encode(),  # 0600
                                  curve_publickey=public, curve_secretkey=secret)
    print(f"starting a worker kernel; attach with nbremote.AttachedKernel({connection_file!r})", flush=True)
    # the launcher removes the file when the kernel ends, as ipykernel does at a normal exit (its keys with it)
    argv = [sys.executable, "-c", _KERNEL, connection_file, f"--IPKernelApp.connection_file={connection_file}",
            f"--ip={ip}", "--HistoryManager.enabled=False"]
    os.execv(sys.executable, argv)
    return 0  # not reached


# What ``nbremote worker`` becomes: the kernel, which ends normally on SIGTERM, SIGHUP and SIGQUIT too (a
# kill, a closed terminal, the Ctrl-backslash that ipykernel's banner tells its user to press), so that the
# cleanup at exit runs -- ipykernel removes the connection file (it writes it again once bound), and so does
# this, with the keys that ``worker`` may have put in it -- instead of dying with them left behind. The file
# goes at once, in the handler: the SystemExit it raises lands wherever the main thread is, and code there
# can swallow it (1 in 8-20 kernels sent SIGQUIT kept running; one aborted) -- then the kernel ends for good
# 5 s later.
_KERNEL = """import atexit, contextlib, os, signal, sys, threading
connection_file = sys.argv.pop(1)
def remove():
    with contextlib.suppress(OSError):
        os.unlink(connection_file)
atexit.register(remove)
def stop(signum, frame):
    remove()
    last = threading.Timer(5.0, os._exit, args=(128 + signum,))
    last.daemon = True
    last.start()
    sys.exit(128 + signum)
for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
    signal.signal(sig, stop)
if sys.path[0] == "":  # as ipykernel_launcher: the kernel puts the working directory back itself
    del sys.path[0]
from ipykernel.kernelapp import launch_new_instance
launch_new_instance()
"""


def parser() -> argparse.ArgumentParser:
    main = argparse.ArgumentParser(
        prog="nbremote", description="nbremote: put parts of a model in other Jupyter kernels and drive them "
        "from your notebook. In a notebook: %load_ext nbremote (see notebooks/).")
    sub = main.add_subparsers(dest="command", required=True, metavar="{demo,worker}")
    demo = sub.add_parser("demo", help="train a model split across local worker kernels, then shut down cleanly",
                          description=DEMO_HELP, formatter_class=argparse.RawDescriptionHelpFormatter,
                          epilog="examples:\n  nbremote demo\n  nbremote demo --workers 3 --steps 50\n"
                                 "  nbremote demo --framework tensorplay\n  nbremote demo --tour")
    demo.add_argument("--workers", type=_positive, default=2, metavar="N",
                      help="worker kernels to start, one model stage each (default: 2)")
    demo.add_argument("--steps", type=_positive, default=30, metavar="N", help="training steps (default: 30)")
    demo.add_argument("--framework", choices=("torch", "tensorplay"), default="torch",
                      help="build the model with torch (default) or tensorplay")
    demo.add_argument("--tour", action="store_true",
                      help="instead of training, tour the RPC layer: calls, RRefs, a remote error")
    work = sub.add_parser("worker", help="start a kernel that a notebook elsewhere can attach to",
                          description=WORKER_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    work.add_argument("--connection-file", default=os.path.abspath("nbremote-worker.json"),
                      help="where to write the connection file (default: ./nbremote-worker.json)")
    work.add_argument("--ip", default="127.0.0.1", help="address the kernel listens on (default: 127.0.0.1); "
                      "beyond loopback its channels are encrypted (CurveZMQ). 'auto': this host's address on its "
                      "route to --driver")
    work.add_argument("--driver", metavar="ADDR", help="the address of the notebook's machine: --ip auto listens on "
                      "this host's address on the route there, and a loopback --ip is refused")
    work.add_argument("--no-encrypt", dest="encrypt", action="store_false",
                      help="beyond loopback, do not encrypt (a network you trust only; a warning says so)")
    return main


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.command == "demo":
        from nbremote import _demo

        if args.tour:
            return _demo.tour(args.workers)
        return _demo.train(args.workers, args.steps, args.framework)
    return worker(args.connection_file, args.ip, args.encrypt, args.driver)


if __name__ == "__main__":
    sys.exit(main())
