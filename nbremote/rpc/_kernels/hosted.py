"""Workers hosted by a Jupyter server: ``ServerKernel(url, token=..., kernel_name=... | kernel_id=...)``.

The kernel is started (or found) through the server's REST API -- ``POST /api/kernels``, ``GET``/``DELETE
/api/kernels/<id>``, ``POST .../interrupt`` -- and reached over its kernel websocket (``_transport.wslink``). This is
how kernels of a JupyterLab / Jupyter Server, a JupyterHub user's server, a Kernel Gateway or an
Enterprise Gateway (Kubernetes, YARN) are reached: nothing but HTTP(S) between the driver and them.
The token travels as an ``Authorization: token ...`` header, never in a URL.

A kernel nbremote started (``kernel_name``) is deleted through the server when its worker is removed
or the world shuts down; one it attached to (``kernel_id``) is left running. If the driver dies, the
worker's lease frees what the driver held there (``_wire.lease``), and a kernel the driver started asks its
server to delete it (``delete_own_kernel``: it cannot just exit, a server restarts a kernel that does) --
where it can read the server's token, on the server's machine; elsewhere the server's culling
(``--MappingKernelManager.cull_idle_timeout``) must.
``ServerKernel.from_env()`` finds the server the notebook itself runs under; there, a worker is started
as a console session named after it, so it shows in JupyterLab's running kernels under its nbremote name
and a user can open a console on it.

Every failure to reach or use the server is a :class:`~nbremote.errors.ServerError` that says what to
fix: the URL (nothing listens, or it is not a Jupyter server), the token, the kernel name (with the
names the server offers) or the kernel id.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from nbremote.errors import ServerError
from nbremote.rpc._kernels.handle import StartedKernel
from nbremote.rpc._transport.websocket import WebSocket
from nbremote.rpc._transport.wscells import CellClient
from nbremote.rpc._transport.wslink import ServerLink, auth_headers, open_websocket

__all__ = ["ServerHostedKernel", "ServerKernel"]

REQUEST_TIMEOUT = 30.0
POLL_SECONDS = 2.0  # how often the server is asked whether it still has the kernel (deleted, culled)
DELETE_RETRY_S = 15.0  # how long a kernel's deletion is tried again while its server answers 5xx


class _API:
    """The REST calls nbremote makes, with errors turned into ServerErrors that name the fix."""

    def __init__(self, url: str, token: str | None, worker: str) -> None:
        parsed = urllib.parse.urlparse(url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ServerError(f"worker {worker!r}: {url!r} is not a Jupyter server URL (http[s]://host:port/[base/])",
                              worker, url=url)
        self.url = url.rstrip("/") + "/"
        self.token = token
        self.worker = worker

    def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method=method,
                                         headers={**auth_headers(self.token), "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT) as response:
                raw = response.read()
        except urllib.error.HTTPError as exc:
            raise self._http_error(method, path, exc) from exc
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise ServerError(
                f"worker {self.worker!r}: cannot reach the Jupyter server at {self.url} ({reason}); is it running, "
                "and is the URL right? (`jupyter server list` shows running servers and their URLs)",
                self.worker, url=self.url) from exc
        try:
            return json.loads(raw) if raw else None
        except ValueError as exc:
            raise ServerError(f"worker {self.worker!r}: {self.url} answered {method} {path} with something that is not "
                              "JSON: is it a Jupyter server's base URL?", self.worker, url=self.url) from exc

    def _http_error(self, method: str, path: str, exc: urllib.error.HTTPError) -> ServerError:
        detail = ""
        try:
            detail = str(json.loads(exc.read()).get("message") or "")
        except Exception:  # a body that is not JSON: the status says enough
            detail = ""
        where = f"{method} {self.url}{path}"
        if exc.code == 403 and "KERNEL_USERNAME" in detail:  # Enterprise Gateway refusing the user (root, by default)
            hint = (f"{detail} -- pass ServerKernel(..., env={{'KERNEL_USERNAME': 'you'}}), or start the gateway "
                    "with EG_UNAUTHORIZED_USERS set to leave that user out")
        elif exc.code in (401, 403):
            hint = ("the server refused the token: pass token=... (the `?token=` part of the URL `jupyter server list` "
                    "prints, or $JUPYTER_TOKEN)" if self.token else
                    "the server needs a token: pass token=... (see `jupyter server list`)")
        elif exc.code == 404 and path == "api/kernels":
            hint = "no Jupyter kernels API there: is the URL the server's base URL (with JupyterHub's /user/NAME/)?"
        else:
            hint = detail or exc.reason
        return ServerError(f"worker {self.worker!r}: {where} failed with HTTP {exc.code}: {hint}", self.worker,
                           url=self.url, status=exc.code)

    def websocket(self, kernel_id: str, name: str) -> WebSocket:
        """A new websocket to a kernel's channels (the v1 protocol where the server offers it)."""
        return open_websocket(self.url, self.token, kernel_id, name, REQUEST_TIMEOUT)

    def kernelspecs(self) -> list[str]:
        try:
            return sorted((self.call("GET", "api/kernelspecs") or {}).get("kernelspecs", {}))
        except ServerError:
            return []


class ServerHostedKernel(StartedKernel):
    """A kernel of a Jupyter server: REST for its lifecycle, its websocket for everything else."""

    kind = "server"
    # Other workers open links of their own to it through the same server: its connection info is the
    # server's URL, the kernel's id and the token (shared with the world's members, as a zmq kernel's key is).

    def __init__(self, api: _API, kernel_id: str, *, owned: bool, session: str | None = None) -> None:
        super().__init__({"kernel_id": kernel_id, "url": api.url, "token": api.token})
        self.api = api
        self.kernel_id = kernel_id
        self.session = session  # the console session nbremote made for it (deleted with it)
        self.owned = owned
        self.host = urllib.parse.urlparse(api.url).hostname or socket.gethostname()
        self.gone: str | None = None  # why the server no longer has the kernel
        self._stopping = threading.Event()
        threading.Thread(target=self._poll, name=f"nbremote-server-poll-{kernel_id[:8]}", daemon=True).start()

    def _poll(self) -> None:
        """Ask the server now and then whether the kernel still exists: a deleted or culled kernel does not
        always close its websocket at once."""
        while not self._stopping.wait(POLL_SECONDS):
            try:
                model = self.api.call("GET", f"api/kernels/{self.kernel_id}")
            except ServerError as exc:
                if exc.status == 404:
                    self.gone = "its server no longer has the kernel (deleted or culled there)"
                    return
                continue  # a server that does not answer for a while: the websocket decides
            if isinstance(model, dict) and model.get("execution_state") == "dead":
                self.gone = "its server reports the kernel dead"
                return

    def alive(self) -> bool:
        return self.gone is None

    def link(self, name: str) -> ServerLink:
        return ServerLink(name, self.websocket(name), kernel_id=self.kernel_id, gone=lambda: self.gone,
                          url=self.api.url)

    def cell_client(self, name: str) -> Any:
        """A client of its own for running cells (``_driver.cells``), on a websocket of its own."""
        return CellClient(name, self.websocket(name))

    def websocket(self, name: str) -> Any:
        """A new websocket to the kernel's channels (the v1 protocol where the server offers it)."""
        return self.api.websocket(self.kernel_id, name)

    def after_driver(self) -> dict[str, Any] | None:
        """A server restarts a kernel that exits, so a kernel nbremote started asks its server to delete it
        (``delete_own_kernel``) -- where it can find the server's token itself: on the same machine."""
        if not self.owned:
            return None
        return {"how": "server", "url": self.api.url, "kernel_id": self.kernel_id, "session": self.session}

    def interrupt(self) -> bool:
        self.api.call("POST", f"api/kernels/{self.kernel_id}/interrupt")
        return True

    def stop(self, timeout: float = 2.0) -> None:
        self._stopping.set()
        if not self.owned:
            return  # attached: the server's and its user's to stop
        try:
            if self.session is not None:  # the session's kernel goes with it
                try:
                    self.api.call("DELETE", f"api/sessions/{self.session}")
                    return
                except ServerError as exc:
                    # jupyter_server answers 500 for a session whose kernel it is restarting (killed under
                    # it): delete the kernel itself then, which also ends the session
                    if exc.status is None or exc.status < 500:
                        raise
            self._delete_kernel()
        except ServerError as exc:
            if exc.status != 404:  # already gone is what we wanted
                raise

    def _delete_kernel(self) -> None:
        """``DELETE`` the kernel; a 5xx (the server is restarting a kernel killed under it, and answers 500
        until the restart is over, ~1-3 s) is tried again for up to ``DELETE_RETRY_S``."""
        deadline = time.monotonic() + DELETE_RETRY_S
        while True:
            try:
                self.api.call("DELETE", f"api/kernels/{self.kernel_id}")
                return
            except ServerError as exc:
                if exc.status is None or exc.status < 500 or time.monotonic() > deadline:
                    raise
            time.sleep(0.5)


def delete_own_kernel(plan: dict[str, Any]) -> str:
    """In a worker whose driver is gone: ask the Jupyter server that runs this kernel to delete it (its
    session with it). The token is the server's own, read from the info file a running server writes
    (``jupyter server list``), found by the server's pid (``$JPY_PARENT_PID``): only a kernel on the server's
    machine, run as its user, can do this -- elsewhere (a gateway's pods) the server's culling must.
    Returns what happened, for the worker's log."""
    try:
        from jupyter_server.serverapp import list_running_servers
    except ImportError:
        return "jupyter_server is not importable here: left for the server to cull"
    parent = os.environ.get("JPY_PARENT_PID", "")
    token = next((str(info.get("token") or "") for info in list_running_servers() if str(info.get("pid")) == parent),
                 None)
    if token is None:
        return "its server runs elsewhere (no info file of a server with pid $JPY_PARENT_PID): left to be culled"
    api = _API(str(plan["url"]), token or None, "self")
    path = f"api/sessions/{plan['session']}" if plan.get("session") else f"api/kernels/{plan['kernel_id']}"
    api.call("DELETE", path)
    return f"asked {api.url} to delete it ({path})"


class ServerKernel:
    """A kernel of a Jupyter Server / Kernel Gateway / Enterprise Gateway at ``url``.

    ``kernel_name``: start a new kernel of that kernelspec there (deleted again when the worker is
    removed); ``kernel_id``: attach to a running kernel (left running). ``token``: the server's token
    (default ``$JUPYTER_TOKEN``). ``session``: start the kernel as a console session named after the
    worker (``POST /api/sessions``), so that JupyterLab lists it under that name and a user can open a
    console on it; by default where the server has sessions (a Jupyter Server; gateways have none).
    ``env``: variables for the new kernel, in the start request's ``env`` -- what gateways read
    (``KERNEL_*`` ones: ``KERNEL_USERNAME``, Enterprise Gateway's ``KERNEL_IMAGE``, ``KERNEL_NAMESPACE``,
    ...); the sessions API takes none, so a kernel with ``env`` is started without a session.
    """

    def __init__(self, url: str, token: str | None = None, *, kernel_name: str | None = None,
                 kernel_id: str | None = None, session: bool | None = None,
                 env: dict[str, str] | None = None) -> None:
        if kernel_name is not None and kernel_id is not None:
            raise ValueError("ServerKernel: give kernel_name (start a kernel) or kernel_id (attach to one), not both")
        if env and session:
            raise ValueError("ServerKernel: a server's sessions API takes no environment; drop session=True or env")
        self.env = dict(env or {})
        self.url = url
        self.token = token if token is not None else os.environ.get("JUPYTER_TOKEN") or None
        self.kernel_name = kernel_name
        self.kernel_id = kernel_id
        self.session = session

    @classmethod
    def from_env(cls, kernel_name: str | None = None, *, session: bool | None = None) -> ServerKernel:
        """The Jupyter server this process runs under, so that workers start beside the notebook's kernel.

        Found, in order: ``$NBREMOTE_SERVER_URL`` (token: ``$NBREMOTE_SERVER_TOKEN`` or ``$JUPYTER_TOKEN``);
        a JupyterHub single-user server (``$JUPYTERHUB_SERVICE_URL``, token ``$JUPYTERHUB_API_TOKEN``); the
        running Jupyter server whose process started this kernel (``$JPY_PARENT_PID``, matched in the
        server info files ``jupyter server list`` reads, which hold its URL and token).
        """
        env = os.environ
        url, token = env.get("NBREMOTE_SERVER_URL"), env.get("NBREMOTE_SERVER_TOKEN") or env.get("JUPYTER_TOKEN")
        if not url and env.get("JUPYTERHUB_SERVICE_URL"):
            url, token = env["JUPYTERHUB_SERVICE_URL"].replace("://0.0.0.0:", "://127.0.0.1:"), \
                env.get("JUPYTERHUB_API_TOKEN")
        if not url:
            parent = env.get("JPY_PARENT_PID") or str(os.getppid())
            try:
                from jupyter_server.serverapp import list_running_servers

                servers = list(list_running_servers())
            except ImportError:
                servers = []
            for info in servers:
                if str(info.get("pid")) == parent:
                    url, token = str(info["url"]), str(info.get("token") or "") or token
                    break
        if not url:
            raise ServerError("no Jupyter server found that runs this process (no $NBREMOTE_SERVER_URL, no "
                              "JupyterHub, and no running server's pid is $JPY_PARENT_PID): pass "
                              "ServerKernel(url, token=...) instead", None)
        return cls(url, token=token, kernel_name=kernel_name, session=session)

    def start(self, name: str) -> ServerHostedKernel:
        api = _API(self.url, self.token, name)
        if self.kernel_id is not None:
            try:
                model = api.call("GET", f"api/kernels/{urllib.parse.quote(self.kernel_id)}")
            except ServerError as exc:
                if exc.status == 404:
                    raise ServerError(f"worker {name!r}: no kernel {self.kernel_id!r} on {api.url} "
                                      "(GET api/kernels lists the running ones)", name, url=api.url,
                                      status=404) from exc
                raise
            return ServerHostedKernel(api, str(model["id"]), owned=False)
        kernel: dict[str, Any] = {"name": self.kernel_name} if self.kernel_name else {}
        try:
            if self.session is not False and not self.env:
                try:  # a console session named after the worker: listed under that name in JupyterLab
                    model = api.call("POST", "api/sessions", {"path": f"nbremote/{name}", "name": name,
                                                              "type": "console", "kernel": kernel})
                    return ServerHostedKernel(api, str(model["kernel"]["id"]), owned=True, session=str(model["id"]))
                except ServerError as exc:
                    if self.session or exc.status not in (404, 405):  # 404/405: a gateway, without sessions
                        raise
            model = api.call("POST", "api/kernels", {**kernel, "env": self.env} if self.env else kernel)
        except ServerError as exc:
            if exc.status is not None and self.kernel_name:  # a 400, 404, 500 or 501, by server
                names = api.kernelspecs()
                if names and self.kernel_name not in names:
                    raise ServerError(f"worker {name!r}: {api.url} has no kernelspec {self.kernel_name!r} "
                                      f"(it offers: {', '.join(names)})", name, url=api.url,
                                      status=exc.status) from exc
            raise
        return ServerHostedKernel(api, str(model["id"]), owned=True)

    def __repr__(self) -> str:
        what = f"kernel_id={self.kernel_id!r}" if self.kernel_id else f"kernel_name={self.kernel_name!r}"
        return f"ServerKernel({self.url!r}, {what})"
