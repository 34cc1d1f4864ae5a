"""A clean stop for the one-process service: uvicorn whose SIGTERM / SIGINT drain the service first.

    server = DrainingServer(uvicorn.Config(app, ...), app.state.service)
    server.run()            # until a signal (or server.drain()), then returns: the process exits 0

The first signal starts the drain (`Service.stop`): new requests get 503 (and /healthz 503,
"draining"), while those already accepted, decoding or queued, go on for up to
`ServerSettings.shutdown_grace_s` (`vlmspec serve --drain-seconds`); what is left then gets 503. The
server keeps listening meanwhile, so a client is told, not refused a connection. Then uvicorn
stops: the answers being sent finish, the lifespan ends, `run()` returns. A second signal cuts the
drain short (503 at the next engine step). Unlike uvicorn's own handlers these neither stop
listening at once nor raise the signal again (exit -15 / 130). A server run off the main thread
(tests: `vlmspec.app.live_server`) gets no signals: `drain()` is what they call.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator
from types import FrameType

import uvicorn

from .service import Service

logger = logging.getLogger("vlmspec.server")
SIGNALS = (signal.SIGINT, signal.SIGTERM)


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, service: Service) -> None:
        super().__init__(config)
        self.service = service
        self._asked = threading.Event()  # drain now (a signal, or drain())
        self._cut = threading.Event()  # stop waiting for the accepted requests (a second signal)
        self._over = False  # the server stopped on its own: the drain thread leaves without draining
        self.drained = threading.Event()  # set once a drain has run to its end

    def drain(self) -> None:
        """Start the drain; called again, cut it short. Safe in a signal handler: it only sets events."""
        (self._cut if self._asked.is_set() else self._asked).set()

    async def serve(self, sockets=None) -> None:
        drainer = threading.Thread(target=self._drain_when_asked, name="vlmspec-drain", daemon=True)
        drainer.start()
        try:
            await super().serve(sockets)
        finally:
            self._over = True
            self._asked.set()

    def _drain_when_asked(self) -> None:
        self._asked.wait()
        if self._over:
            return
        grace = self.service.settings.shutdown_grace_s
        logger.warning("draining: new requests get 503; %d accepted ones get up to %g s to finish (a second signal stops them now)",
                       self.service.active + self.service.waiting, grace)
        self.service.stop(grace, cut=self._cut)
        logger.warning("drained: stopping the server")
        self.drained.set()
        self.should_exit = True

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
            yield
            return
        before = {sig: signal.signal(sig, self._on_signal) for sig in SIGNALS}
        try:
            yield
        finally:
            for sig, handler in before.items():
                signal.signal(sig, handler)

    def _on_signal(self, sig: int, frame: FrameType | None) -> None:
        self.drain()
