"""The ``nbremote`` command: ``nbremote demo`` (the main job) and ``nbremote worker``.

``nbremote demo`` shows what nbremote is for: it starts local worker kernels, trains a model split across
them and this process, prints the loss falling and each worker's parameters, and shuts down leaving no
process behind (``--tour`` runs the RPC layer's tour instead). The demos themselves live in
:mod:`nbremote._demo`. ``nbremote worker`` starts a kernel that a notebook elsewhere can attach to with
``nbremote.AttachedKernel``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import sys
from collections.abc import Sequence

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
signed, their buffers digested).
"""


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def worker(connection_file: str, ip: str, encrypt: bool = True) -> int:
    """Run an ipykernel in the foreground, writing ``connection_file`` for ``AttachedKernel``.

    Beyond loopback (unless ``encrypt`` is False) the connection file is written here first, fresh, with a
    CurveZMQ keypair: ipykernel (>= 7.4) loads it, binds its channels as CurveZMQ servers -- which refuse
    clients that do not hold the key -- and fills in the ports it bound. A Jupyter kernel otherwise signs
    its messages but sends them in clear text (a payload was read off the wire from another network
    namespace, issue 22).
    """
    import zmq

    from nbremote.rpc._wire.envelope import is_loopback

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
                      "beyond loopback its channels are encrypted (CurveZMQ)")
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
    return worker(args.connection_file, args.ip, args.encrypt)


if __name__ == "__main__":
    sys.exit(main())
