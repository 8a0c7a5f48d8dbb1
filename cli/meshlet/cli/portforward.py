"""`kubectl port-forward` in-process: a listener on 127.0.0.1 whose every connection is carried
to a pod's port by a pods/portforward WebSocket through the API server (the `kubernetes`
client's `portforward`), so that a gRPC client can dial a pod the user cannot reach directly."""

from __future__ import annotations

import contextlib
import socket
import threading
from types import TracebackType
from typing import Any, Final

from meshlet.api.hostport import HostPort
from meshlet.cli.cluster import ClusterError

POLL: Final = 0.1  # how often the accepting thread looks for the end
CHUNK: Final = 65536


class PortForward:
    """`with PortForward(api, ns, pod, port) as (host, port):` dials reach the pod's port."""

    def __init__(
        self, api_client: Any, namespace: str, pod: str, port: int, local_port: int = 0
    ) -> None:
        self.namespace, self.pod, self.port = namespace, pod, port
        self.local_port = local_port  # 0: one the system picks
        self._api = api_client
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._sockets: list[Any] = []
        self._clients: list[socket.socket] = []  # the accepted connections (ours to end)
        self._first: Any = None
        self._listener: socket.socket | None = None
        self.errors: list[str] = []  # what the kubelet said on the port's error channel

    @property
    def target(self) -> str:
        return f"{self.namespace}/{self.pod}:{self.port}"

    def _open(self) -> Any:
        from kubernetes import client as k8s
        from kubernetes.client.exceptions import ApiException
        from kubernetes.stream import portforward

        try:
            return portforward(
                k8s.CoreV1Api(self._api).connect_get_namespaced_pod_portforward,
                self.pod, self.namespace, ports=str(self.port),
            )  # fmt: skip
        except ApiException as exc:
            raise ClusterError(
                f"cannot port-forward to {self.target}: {exc.reason or exc.status}"
            ) from None

    def __enter__(self) -> HostPort:
        self._first = self._open()  # the API's refusals surface here, before any dial
        try:
            listener = socket.create_server(("127.0.0.1", self.local_port))
        except OSError as exc:
            self._first.close()
            raise ClusterError(
                f"cannot listen on 127.0.0.1:{self.local_port}: {exc.strerror or exc}"
            ) from None
        listener.settimeout(POLL)
        self._listener = listener
        self._spawn(self._accept, listener)
        return HostPort.from_sockaddr(listener.getsockname())

    def _spawn(self, target: Any, *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True, name="port-forward")
        with self._lock:
            self._threads.append(thread)
        thread.start()

    def _accept(self, listener: socket.socket) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.settimeout(None)
            try:
                with self._lock:
                    forward, self._first = self._first, None
                forward = forward or self._open()
            except ClusterError as exc:
                self.errors.append(exc.message)
                conn.close()
                continue
            remote = forward.socket(self.port)
            with self._lock:
                self._clients.append(conn)
                self._sockets += [conn, remote]
            self._spawn(self._copy, conn, remote, forward)
            self._spawn(self._copy, remote, conn, forward)

    def _copy(self, source: Any, sink: Any, forward: Any) -> None:
        """One direction, then its end passed on as a half-close (SHUT_WR). The `kubernetes`
        client's own thread writes into `forward.socket()`'s peer until it reads our end's
        EOF: shutting that socket for reading first would make its next write fail (EPIPE) in
        a thread that is not ours."""
        with contextlib.suppress(OSError):
            while data := source.recv(CHUNK):
                sink.sendall(data)
        if (error := forward.error(self.port)) and error.strip() not in self.errors:
            self.errors.append(error.strip())  # before the client sees the connection end
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        if self._listener is not None:
            self._listener.close()
        with self._lock:
            first, self._first = self._first, None
            sockets = list(self._sockets)
            clients = list(self._clients)
        if first is not None:
            first.close()
        # The local ends only: each copy then passes the end on, and the `kubernetes` client's
        # thread ends once it reads it (its sockets are closed after, when it no longer writes).
        for sock in clients:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(timeout=5)
        for sock in sockets:
            sock.close()
