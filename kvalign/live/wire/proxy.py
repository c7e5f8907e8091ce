"""An XSUB -> XPUB proxy that stops promptly on SIGTERM / SIGINT.

``zmq.proxy`` blocks in libzmq; a Python signal handler runs only once that call comes back to the
interpreter, and it came back too late or not at all on a loaded CI machine (the broker outlived a
5 s ``terminate()`` wait). So the proxy runs in a thread as ``zmq.proxy_steerable``, the calling
thread waits for the signal with ``sigwait`` (both signals blocked, so no handler races it), and
stopping is libzmq's own ``TERMINATE`` command on the control socket.
"""

from __future__ import annotations

import signal
import threading

import zmq

STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}

#: Seconds the proxy thread may take to act on TERMINATE before the process goes on without it.
JOIN_TIMEOUT_S = 5.0


def proxy_until_signalled(ctx: zmq.Context, front: zmq.Socket, back: zmq.Socket) -> int:
    """Relay ``front`` -> ``back`` until SIGTERM or SIGINT; return the signal's number.

    Must be called from the main thread; the sockets are the proxy thread's from here on.
    """
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)  # the proxy thread inherits the mask
    ours, theirs = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    address = f"inproc://kvalign-proxy-control-{id(ours):x}"
    ours.bind(address)
    theirs.connect(address)
    worker = threading.Thread(target=_relay, args=(front, back, theirs), name="zmq-proxy", daemon=True)
    worker.start()
    try:
        return signal.sigwait(STOP_SIGNALS)
    finally:
        ours.send(b"TERMINATE")
        worker.join(JOIN_TIMEOUT_S)
        ours.close(linger=0)
        theirs.close(linger=0)
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _relay(front: zmq.Socket, back: zmq.Socket, control: zmq.Socket) -> None:
    try:
        zmq.proxy_steerable(front, back, None, control)
    except zmq.ContextTerminated:
        pass
