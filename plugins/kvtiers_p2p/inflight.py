"""What the p2p client's I/O thread (:mod:`.client`) keeps track of: jobs and their keys,
requests in flight, lookups across peers, and each peer's connection state."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import zmq

HELLO_RETRY_S = (0.1, 1.0)  #: a refused HELLO is said again on the same connection after this, doubling to the max


@dataclass
class JobState:
    job_id: int
    t0: float
    deadline: float
    left: int
    failed: list[bytes] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    nbytes: int = 0


@dataclass
class Item:
    """One key of a load or store job."""

    key: bytes
    slot: int
    job: JobState
    candidates: list[str] = field(default_factory=list)  # peers still to try (loads)
    done: bool = False


@dataclass
class Request:
    kind: str  # "get", "put", "lookup", "hello", "pin", "unpin"
    rid: int
    deadline: float
    frames: list[Any]
    items: list[Item] = field(default_factory=list)
    keys: list[bytes] = field(default_factory=list)  # lookup
    probe: Any = None
    sent: bool = False
    answered: set[int] = field(default_factory=set)
    peer: Any = None  # getn: the peer it was sent to
    instance: str | None = None  # getn: the server instance it was sent to
    why: str = ""  # getn being fenced: why it failed
    fence: float = 0.0  # getn being fenced: when to give up waiting for the server
    tracker: Any = None  # put sent zero-copy: done once ZMQ no longer reads the slot
    done: Any = None  # pin: called with the server's answer (a dict) or why it failed (a str)


@dataclass
class Probe:
    """A lookup of some keys across all peers."""

    keys: list[bytes]
    waiting: int
    found: dict[bytes, list[str]] = field(default_factory=dict)


class Peer:
    """One peer: its socket, its monitor, its handshake and its requests."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.sock: zmq.Socket | None = None
        self.mon: zmq.Socket | None = None
        self.ready = False
        self.instance: str | None = None
        self.error: str | None = None  # the server's refusal of our HELLO
        self.max_inflight = 16
        self.queue: deque[Request] = deque()
        self.inflight: dict[int, Request] = {}
        self.gets = 0
        self.connected = False
        self.hello_rid: int | None = None
        self.retry_at = 0.0  # refused: when to say HELLO again on this connection
        self.backoff = HELLO_RETRY_S[0]
        self.nixl = True  # ask it for NIXL loads (with a NIXL client); False once it said it serves none
        self.pins = False  # its HELLO answer said it keeps pins (PIN/UNPIN)
        self.pinned = False  # this client pinned there: closing unpins all its pins before BYE
