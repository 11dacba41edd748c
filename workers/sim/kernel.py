"""The explorer's machinery: simulated time, simulated worker processes whose task threads take turns (one runs at
a time, handed over at the seams the job code exposes), an in-memory broker and object store, and the seeded
fault decisions taken at each seam. Everything a run does follows from its seed."""

from __future__ import annotations

import heapq
import io
import itertools
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import IO, Any

from storage.clock import SystemClock
from storage.liveness import WorkerIdentity
from storage.objectstore import ObjectStore

EPOCH = datetime(2026, 1, 1, tzinfo=UTC)
KILLED_AFTER_PAUSE = 0.3  # a process paused inside a PUT is killed as the PUT lands, this often
FOCUS_SHARE = 0.3  # the seeds whose faults gather on one family of seams (`FaultProfile.focus`)
FOCUS_FAMILIES = ("store delete", "store put", "store get", "store list", "crash point", "send", "database", "engine",
                  "sleep")
_local = threading.local()


class SimCrash(BaseException):
    """The simulated process died here; its thread unwinds and writes nothing more."""


@dataclass
class FaultProfile:
    """How often each fault strikes at a seam while faults are on (drawn per seed)."""

    crash: float = 0.0
    pause: float = 0.0
    db_error: float = 0.0
    lost_commit_reply: float = 0.0
    store_error: float = 0.0
    ambiguous_put: float = 0.0
    send_drop: float = 0.0
    send_duplicate: float = 0.0
    send_delay: float = 0.0
    reorder: bool = False
    # one family of seams where this seed's processes pause or crash far more often (FoundationDB's "buggify"):
    # a window that needs a pause at one rare step, such as a cleanup's delete, is reached in hundreds of seeds,
    # not in millions
    focus: str | None = None
    focus_pause: float = 0.0
    focus_crash: float = 0.0

    @classmethod
    def draw(cls, rng: random.Random) -> FaultProfile:
        def maybe(high: float) -> float:
            return rng.choice((0.0, 0.0, rng.uniform(0, high)))

        return cls(crash=maybe(0.06), pause=maybe(0.05), db_error=maybe(0.03), lost_commit_reply=maybe(0.04),
                   store_error=maybe(0.08), ambiguous_put=maybe(0.1), send_drop=maybe(0.15),
                   send_duplicate=maybe(0.2), send_delay=maybe(0.3), reorder=rng.random() < 0.5)

    def focused(self, rng: random.Random) -> FaultProfile:
        """This profile, its faults gathered on one family of seams in FOCUS_SHARE of the draws."""
        if rng.random() >= FOCUS_SHARE:
            return self
        return replace(self, focus=rng.choice(FOCUS_FAMILIES), focus_pause=rng.uniform(0.1, 0.5),
                       focus_crash=rng.choice((0.0, rng.uniform(0, 0.2))))

    def pause_at(self, seam: str) -> float:
        """The chance to pause at this seam (its name, e.g. "store delete")."""
        return self.focus_pause if self.focus and seam.startswith(self.focus) else self.pause

    def crash_at(self, seam: str) -> float:
        return max(self.crash, self.focus_crash) if self.focus and seam.startswith(self.focus) else self.crash


@dataclass
class Incarnation:
    """One life of a simulated worker process: a crash ends it, a restart begins the next with a new identity."""

    worker: int
    generation: int
    host: str
    identity: WorkerIdentity
    alive: bool = True
    paused_until: float = 0.0
    slots: dict[str, Actor | None] = field(default_factory=lambda: {"gpu": None, "control": None, "beat": None,
                                                                     "api": None})

    def __str__(self) -> str:
        return f"{'api' if self.worker < 0 else f'w{self.worker}'}.{self.generation}"


class Actor:
    """One task running on an incarnation, in a thread of its own that runs only while the scheduler waits."""

    def __init__(self, sim: Kernel, incarnation: Incarnation, slot: str, name: str, work: Callable[[], Any],
                 message: Message | None) -> None:
        self.sim, self.incarnation, self.slot, self.name, self.work = sim, incarnation, slot, name, work
        self.message = message
        self.go, self.back = threading.Lock(), threading.Lock()  # held: closed; a release lets the waiter pass
        self.go.acquire()
        self.back.acquire()
        self.finished, self.crashed, self.error, self.result = False, False, None, None
        self.connections = 0  # database connections this thread holds now: no hand-over while it holds one
        self.thread = threading.Thread(target=self._main, name=f"sim-{incarnation}-{name}", daemon=True)
        self.thread.start()

    def _main(self) -> None:
        self.go.acquire()
        _local.actor = self
        try:
            self.result = self.work()
        except SimCrash:
            self.crashed = True
        except BaseException as error:  # the scheduler judges it: a task failure, or a retry
            self.error = error
        finally:
            _local.actor = None
            self.finished = True
            self.back.release()

    def step(self) -> None:
        """(scheduler thread) Let the actor run up to its next hand-over or its end."""
        self.go.release()
        self.back.acquire()

    def hand_over(self) -> None:
        """(actor thread) Give the turn back; raises SimCrash when resumed in a dead incarnation."""
        self.back.release()
        self.go.acquire()
        if not self.incarnation.alive:
            raise SimCrash


def current_actor() -> Actor | None:
    return getattr(_local, "actor", None)


def beating() -> Incarnation | None:
    return getattr(_local, "beating", None)


@dataclass
class Message:
    id: int
    task: str
    args: tuple
    queue: str
    ready_at: float
    sends: int = 1  # how many times this message (by id) was handed to the broker


class SimBroker:
    """Queues in memory, with the broker marker's keys (the simulated Redis) beside them."""

    def __init__(self) -> None:
        self.messages: list[Message] = []
        self.keys: dict[str, bytes] = {}

    def ready(self, queue: str, now: float) -> list[Message]:
        return [m for m in self.messages if m.queue == queue and m.ready_at <= now]

    def count(self, queue: str, now: float) -> int:
        return len(self.ready(queue, now))

    def flush(self) -> None:
        self.messages.clear()
        self.keys.clear()

    # the marker's client (`workers.broker_marker.broker_client`)
    def __call__(self, broker_url: str) -> SimBroker:
        return self

    def __enter__(self) -> SimBroker:
        return self

    def __exit__(self, *exc) -> None:
        return None

    def get(self, key: str) -> bytes | None:
        return self.keys.get(key)

    def set(self, key: str, value: bytes) -> None:
        self.keys[key] = value


class SimStore(ObjectStore):
    """An in-memory object store; every operation is a seam (a hand-over, and maybe a fault)."""

    def __init__(self, sim: Kernel, uri: str) -> None:
        self.sim, self.uri = sim, uri
        self.objects = sim.objects.setdefault(uri, {})

    def _put(self, key: str, data: bytes) -> None:
        paused = self.sim.store_seam("put", self.uri, key)
        self.objects[key] = (data, next(self.sim.versions))
        self.sim.after_put(self.uri, key, paused)

    def put_bytes(self, key: str, data: bytes) -> None:
        self._put(key, bytes(data))

    def put_file(self, key: str, path) -> None:
        with open(path, "rb") as f:
            self._put(key, f.read())

    def put_stream(self, key: str, source: IO[bytes]) -> None:
        self._put(key, source.read())

    def open(self, key: str) -> IO[bytes]:
        self.sim.store_seam("get", self.uri, key)
        if key not in self.objects:
            raise FileNotFoundError(f"{self.uri}/{key}")
        return io.BytesIO(self.objects[key][0])

    def exists(self, key: str) -> bool:
        self.sim.store_seam("head", self.uri, key)
        return key in self.objects

    def list(self, prefix: str = "") -> list[str]:
        self.sim.store_seam("list", self.uri, prefix)
        return sorted(k for k in self.objects if k.startswith(prefix))

    def fingerprint(self, key: str) -> dict[str, Any]:
        self.sim.store_seam("head", self.uri, key)
        if key not in self.objects:
            raise FileNotFoundError(f"{self.uri}/{key}")
        data, version = self.objects[key]
        return {"size": len(data), "etag": str(version)}

    def delete(self, key: str) -> None:
        self.sim.store_seam("delete", self.uri, key)
        self.objects.pop(key, None)


class SimClock(SystemClock):
    """Simulated time: the database's clock is the true one; each host's wall clock is skewed by its own offset."""

    def __init__(self, sim: Kernel) -> None:
        self.sim = sim

    def utcnow(self) -> datetime:
        return EPOCH + timedelta(seconds=self.sim.now + self.sim.skew_here())

    def database_now(self) -> datetime:
        return EPOCH + timedelta(seconds=self.sim.now)

    def monotonic(self) -> float:
        return self.sim.now

    def sleep(self, seconds: float) -> None:
        self.sim.seam("sleep", duration=seconds)

    def periodic(self, every_s: float, tick: Callable[[], None], stop: threading.Event,
                 name: str) -> threading.Thread | None:
        actor = current_actor()
        if actor is not None:
            self.sim.schedule(every_s, "beat", (actor.incarnation, every_s, tick, stop))
        return None


class TransientStoreError(ConnectionError):
    """A simulated object-store failure (a 5xx, a timeout, the service unreachable)."""


class Kernel:
    """Time, turns and fault decisions. The world (`workers.sim.world`) drives it with events."""

    def __init__(self, seed: int, faults: FaultProfile) -> None:
        self.seed, self.rng, self.faults = seed, random.Random(seed), faults
        self.now = 0.0
        self.faults_on = True
        self.events: list[tuple[float, int, str, Any]] = []
        self.order = itertools.count()
        self.versions = itertools.count(1)
        self.objects: dict[str, dict[str, tuple[bytes, int]]] = {}
        self.broker = SimBroker()
        self.skews: dict[str, float] = {}
        self.front_host = "front"
        self.store_down_until = 0.0
        self.schedule_log: list[str] = []
        self.incarnations: list[Incarnation] = []

    # -- events -------------------------------------------------------------------------------------

    def schedule(self, delay: float, kind: str, payload: Any = None) -> None:
        heapq.heappush(self.events, (self.now + max(0.0, delay), next(self.order), kind, payload))

    def note(self, what: str) -> None:
        """A fault, as the schedule that a failing seed prints."""
        self.schedule_log.append(f"t={self.now:9.1f}s {what}")

    # -- where the job code reaches time, identity and services --------------------------------------

    def skew_here(self) -> float:
        actor = current_actor()
        host = actor.incarnation.host if actor else (inc.host if (inc := beating()) else self.front_host)
        return self.skews.get(host, 0.0)

    def identity_here(self) -> WorkerIdentity:
        actor = current_actor()
        incarnation = actor.incarnation if actor else beating()
        if incarnation is not None:
            return incarnation.identity
        return WorkerIdentity(self.front_host, 1, "", "", "front")

    def acting(self) -> Incarnation | None:
        actor = current_actor()
        return actor.incarnation if actor else beating()

    def seam(self, name: str, duration: float | None = None) -> bool:
        """A step boundary of the job code: the worker may crash or pause here, and hands the turn over (unless
        it holds a database connection: no other worker could then take its locks). True if it paused."""
        actor = current_actor()
        if actor is None:
            return False
        incarnation = actor.incarnation
        if not incarnation.alive:
            raise SimCrash
        if self.faults_on and self.rng.random() < self.faults.crash_at(name):
            self.crash(incarnation, f"at {name} ({actor.name})")
            raise SimCrash
        if actor.connections:
            return False
        paused = self.faults_on and self.rng.random() < self.faults.pause_at(name)
        if paused:
            pause = self.rng.uniform(1.2, 3.0) * self.lease_s
            incarnation.paused_until = max(incarnation.paused_until, self.now + pause)
            self.note(f"{incarnation} paused {pause:.0f}s at {name} ({actor.name})")
        wait = self.rng.uniform(0.0, 2.0) if duration is None else duration
        self.schedule(wait, "resume", actor)
        actor.hand_over()
        return paused

    lease_s = 120.0

    def crash(self, incarnation: Incarnation, where: str) -> None:
        if not incarnation.alive:
            return
        incarnation.alive = False
        self.note(f"{incarnation} crashed {where}")
        self.schedule(self.rng.uniform(5, 90), "restart", incarnation)

    def database_seam(self) -> None:
        """Before each statement: a dead process's connection is gone; while faults are on, the database may
        fail the statement (a transient error)."""
        incarnation = self.acting()
        if incarnation is None:
            return
        if not incarnation.alive:
            raise SimCrash
        if self.faults_on and self.rng.random() < self.faults.db_error:
            from sqlalchemy.exc import OperationalError

            self.note(f"{incarnation} database error")
            raise OperationalError("simulated", None, ConnectionError("the database went away (simulated)"))

    def commit_seam(self) -> None:
        """After a commit: the reply may be lost (committed, but the client sees an error)."""
        incarnation = self.acting()
        if incarnation is None or not self.faults_on or self.rng.random() >= self.faults.lost_commit_reply:
            return
        from sqlalchemy.exc import OperationalError

        self.note(f"{incarnation} lost a commit reply")
        raise OperationalError("simulated COMMIT", None, ConnectionError("connection lost after COMMIT (simulated)"))

    def store_seam(self, op: str, uri: str, key: str) -> bool:
        """Before a store call; True if the process paused here (a PUT's request had left: it lands after)."""
        paused = self.seam(f"store {op}")
        incarnation = self.acting()
        if incarnation is None:
            return paused
        if self.now < self.store_down_until:
            raise TransientStoreError(f"object store unreachable (simulated outage) on {op} {key}")
        if self.faults_on and self.rng.random() < self.faults.store_error:
            self.note(f"{incarnation} store error on {op} {key}")
            raise TransientStoreError(f"object store error (simulated) on {op} {key}")
        return paused

    def after_put(self, uri: str, key: str, paused: bool = False) -> None:
        """The object landed: the process may die (or pause) before the reply reaches it, or the reply is lost.
        A process that paused inside its PUT (the request left before, its client retried after) may be killed
        as it lands: its supervisor gave up on it while it did not answer."""
        incarnation = self.acting()
        if incarnation is not None and paused and self.rng.random() < KILLED_AFTER_PAUSE:
            self.crash(incarnation, f"as its PUT {key} landed after a pause (killed by its supervisor)")
            raise SimCrash
        self.seam("store put landed")
        if incarnation is not None and self.faults_on and self.rng.random() < self.faults.ambiguous_put:
            self.note(f"{incarnation} ambiguous PUT {key} (stored, reported failed)")
            raise TransientStoreError(f"timeout waiting for the PUT of {key} (simulated; it landed)")

    def store(self, uri: str) -> SimStore:
        return SimStore(self, uri)
