"""One seeded run: a fleet of simulated Celery workers running the real tasks (`workers.tasks`: plan, run_shard,
finalize, the sweep with its broker-loss resend) over a real database, jobs arriving through the real intake and
cancelled through the real cancel, while the seed's faults strike; then faults stop, the fleet settles, and the
checker (`workers.sim.checker`) judges what is left."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import random
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from sqlalchemy import event, func, select, text
from sqlalchemy.orm import Session, sessionmaker

from storage import clock, db, faults, liveness, migrate, objectstore
from storage.faults import is_transient
from storage.models import Job, ServiceMarker
from storage.objectstore import S3Options, normalize_uri
from workers import broker_marker
from workers.sim.api import SimApi
from workers.sim.engine import ROW_SECONDS, SimEngineLoop, SimWorkerProcess
from workers.sim.kernel import (
    Actor,
    FaultProfile,
    Incarnation,
    Kernel,
    Message,
    SimClock,
    SimCrash,
    _local,
    current_actor,
)
from workers.sim.plan import BUCKET, JobPlan

MODEL = "smollm2-135m"
FAULTS_FOR_S = 1200.0  # faults strike during the first 20 minutes of simulated time
SETTLE_BOUND_S = 3 * 3600.0  # invariant 3: every job is terminal within this after the faults stop
SWEEP_INTERVAL_S, SWEEP_GRACE_S = 120.0, 600.0
VISIBILITY_S = 6 * 3600.0  # Redis hands a dead worker's unacknowledged task out again after this
RETRY_S = 15.0  # a task that raised a transient error is retried after this (Celery's retry)
API_CLEANUP_S, API_POLL_S = 600.0, 300.0  # the API's cleanup of expired files; a client's polls of its batch
BUSY_SHARE, BUSY_ROW_S, BUSY_TAIL_S = 0.015, 120.0, 1000.0  # busy seeds: their share, engine s/row, arrivals after
LOST_WORK_S = SWEEP_GRACE_S + 2 * SWEEP_INTERVAL_S  # invariant 7: the longest a shard may wait with no task
SIM_MARKER = "tokenmill-sim"  # a database the explorer wrote (`Database`)
PREFIX_WAIT_S = 3600.0  # a job refused for a live job on its output prefix is sent again until this passed
FRONT = -1  # the API's process, in `Incarnation.worker`
SLOT_OF = {"tokenmill.run_shard": "gpu", "tokenmill.plan_job": "control", "tokenmill.finalize_job": "control"}


@dataclass
class Outcome:
    seed: int
    violations: list[str]
    schedule: list[str]
    statuses: dict[str, str]
    task_errors: list[str] = field(default_factory=list)
    simulated_s: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.violations


def draw_jobs(kernel: Kernel, steady_arrivals: bool) -> list[JobPlan]:
    rng = kernel.rng
    count = rng.randint(1, 2) + (rng.randint(1, 3) if steady_arrivals else 0)
    jobs = []
    for index in range(count):
        at = 0.0 if index == 0 else rng.uniform(0, FAULTS_FOR_S)
        window = rng.choice(("24h", "24h", "24h", "20m", "45m"))
        jobs.append(JobPlan(index, rng.randint(1, 8), rng.randint(2, 4), window, at, rng.random() < 0.3))
        if rng.random() < 0.12:
            jobs[-1].api, jobs[-1].openai_output = True, True
            jobs[-1].output_expires_after = 3600 if rng.random() < 0.25 else None
        elif index and rng.random() < 0.35 and not (earlier := rng.choice(jobs[:-1])).api:
            # a later job on an earlier one's output prefix (it waits while a live job holds it)
            jobs[-1].prefix_of = earlier.index if earlier.prefix_of is None else earlier.prefix_of
            jobs[-1].arrives_at = max(at, earlier.arrives_at + 1)
            if earlier.cancel_at is None and rng.random() < 0.5:  # a replacement: the earlier one cancelled soon
                earlier.cancel_at = earlier.arrives_at + rng.uniform(0, 60)
                jobs[-1].arrives_at = earlier.cancel_at + rng.uniform(0, 30)
        if rng.random() < 0.25:
            jobs[-1].cancel_at = at + rng.uniform(0, 900)
    return jobs


def draw_busy_jobs(rng: random.Random, first: int) -> list[JobPlan]:
    jobs, at = [], 0.0
    while at < FAULTS_FOR_S + BUSY_TAIL_S:
        at += rng.uniform(120, 360)
        jobs.append(JobPlan(first + len(jobs), rng.randint(4, 8), 2, "24h", at, False))
    return jobs


class Database:
    """A fresh database per run, on one engine kept across runs (its statement cache stays warm): a migrated
    SQLite template copied over the run's file, or PostgreSQL's tables emptied."""

    def __init__(self, url: str | None) -> None:
        self.url, self.workdir = url, None
        if url is None:
            self.workdir = Path(tempfile.mkdtemp(prefix="tokenmill-sim-", dir=_fast_tmp()))
            self.template, self.path = self.workdir / "template.db", self.workdir / "run.db"
            migrate.upgrade(f"sqlite:///{self.template}")
            url = f"sqlite:///{self.path}"
        else:
            migrate.upgrade(url)
        self.sessions = db.session_factory(db.make_engine(url))
        if self.url is not None:
            self._check_ours()

    def _check_ours(self) -> None:
        """Refuse a database holding jobs the explorer did not write: it empties the tables for every seed."""
        with self.sessions() as session:
            jobs = session.scalar(select(func.count()).select_from(Job))
            ours = session.get(ServiceMarker, SIM_MARKER) is not None
        if jobs and not ours:
            raise ValueError(f"{db.describe(self.url)} holds {jobs} job(s) that the fault explorer did not write; "
                             f"give it an empty database (it empties every table for each seed)")

    def fresh(self) -> sessionmaker[Session]:
        engine = self.sessions.kw["bind"]
        engine.dispose()
        if self.url is None:
            for suffix in ("-wal", "-shm"):
                Path(f"{self.path}{suffix}").unlink(missing_ok=True)
            shutil.copyfile(self.template, self.path)
            return self.sessions
        with engine.begin() as connection:
            tables = [name for (name,) in connection.execute(text(
                "SELECT tablename FROM pg_tables WHERE schemaname = current_schema() AND tablename != "
                "'alembic_version'"))]
            connection.execute(text(f"TRUNCATE {', '.join(tables)} RESTART IDENTITY CASCADE"))
        with self.sessions.begin() as session:
            session.add(ServiceMarker(name=SIM_MARKER, value="the fault explorer's database"))
        return self.sessions

    def close(self) -> None:
        self.sessions.kw["bind"].dispose()
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)


def _fast_tmp() -> str | None:
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() else None


class World:
    def __init__(self, seed: int, workers: int, sessions: sessionmaker[Session]) -> None:
        self.kernel = kernel = Kernel(seed, FaultProfile())
        # the focus is drawn apart from the seed's other draws, which stay as they were
        kernel.faults = FaultProfile.draw(kernel.rng).focused(random.Random(f"focus-{seed}"))
        self.sessions, self.workers = sessions, workers
        self.steady = kernel.rng.random() < 0.3
        self.jobs = draw_jobs(kernel, self.steady)
        # a busy seed: work keeps arriving past the faults, more than the workers do, so the model's queue is
        # seldom empty (drawn apart from the seed's other draws, which stay as they were)
        busy = random.Random(f"busy-{seed}")
        self.busy = busy.random() < BUSY_SHARE
        if self.busy:
            self.jobs += draw_busy_jobs(busy, len(self.jobs))
        self.lost_since: dict[int, float] = {}  # shard id -> since when it has waited with no task (faults off)
        self.lost_work: list[str] = []
        self.process: SimWorkerProcess | None = None  # while wired
        self.ids = random.Random(f"ids-{seed}")
        self.api: SimApi | None = None
        self.task_errors: list[str] = []
        self.message_ids = iter(range(1, 1 << 30))
        self.worker_host = [f"host{i}" for i in range(workers)]
        if (faults := kernel.faults).focus:
            kernel.note(f"faults gather at the {faults.focus!r} seams: pause {faults.focus_pause:.2f}, "
                        f"crash {faults.crash_at(faults.focus):.2f}")
        for host in [*self.worker_host, kernel.front_host]:
            if kernel.rng.random() < 0.3:
                kernel.skews[host] = kernel.rng.choice((-3600.0, -90.0, 45.0, 3600.0))
                kernel.note(f"clock of {host} off by {kernel.skews[host]:+.0f}s")

    # -- wiring the real code to the simulation (all patching happens here) --------------------------

    @contextlib.contextmanager
    def wired(self) -> Iterator[None]:
        from workers import tasks

        kernel, bind = self.kernel, self.sessions.kw["bind"]
        config = dataclasses.replace(tasks.config, broker_url="redis://sim/0", sweep_interval_s=SWEEP_INTERVAL_S,
                                     sweep_grace_s=SWEEP_GRACE_S, max_shard_attempts=3, max_control_attempts=3)
        queues = {"control": config.control_queue, "gpu": config.model_queue(MODEL)}
        patches = [(tasks, "sessions", lambda: self.sessions), (tasks, "config", config),
                   (tasks, "queued_tasks", lambda model: kernel.broker.count(queues["gpu" if model else "control"],
                                                                             kernel.now)),
                   (tasks, "worker_process", lambda: self.process),
                   (broker_marker, "broker_client", kernel.broker),
                   (liveness, "this_worker", kernel.identity_here),
                   (objectstore, "simulated_stores", kernel.store),
                   (faults, "crash_hook", self._crash_point),
                   (uuid, "uuid4", self._uuid4)]
        for name in SLOT_OF:
            task = tasks.app.tasks[name]
            patches.append((task, "apply_async", self._sender(name)))
        saved = [(target, name, target.__dict__.get(name, _MISSING)) for target, name, _ in patches]
        for target, name, value in patches:
            setattr(target, name, value)
        previous_clock = clock.install(SimClock(kernel))
        self.process = SimWorkerProcess(SimEngineLoop(kernel.seam, BUSY_ROW_S if self.busy else ROW_SECONDS))
        event.listen(bind, "before_cursor_execute", self._before_statement)
        event.listen(bind.pool, "checkout", self._checkout)
        event.listen(bind.pool, "checkin", _checkin)
        event.listen(self.sessions, "after_commit", self._after_commit)
        try:
            yield
        finally:
            event.remove(self.sessions, "after_commit", self._after_commit)
            event.remove(bind.pool, "checkin", _checkin)
            event.remove(bind.pool, "checkout", self._checkout)
            event.remove(bind, "before_cursor_execute", self._before_statement)
            self.process = None
            clock.install(previous_clock)
            for target, name, value in reversed(saved):
                if value is _MISSING:
                    delattr(target, name)
                else:
                    setattr(target, name, value)

    def _uuid4(self) -> uuid.UUID:
        """Seeded: ids the code makes (a batch's job id) order the sweep's work, hence the faults drawn."""
        return uuid.UUID(int=self.ids.getrandbits(128), version=4)

    def _checkout(self, dbapi_connection, record, proxy) -> None:
        """Taking a connection, before any transaction: a step boundary (no lock held yet)."""
        actor = current_actor()
        if actor is not None and not actor.connections:
            self.kernel.seam("database")
        record.info["sim_actor"] = actor
        if actor is not None:
            actor.connections += 1

    def _before_statement(self, *args) -> None:
        self.kernel.database_seam()

    def _after_commit(self, session) -> None:
        self.kernel.commit_seam()

    def _crash_point(self, name: str) -> None:
        kernel, actor, seam = self.kernel, current_actor(), f"crash point {name}"
        if actor is not None and kernel.faults_on and kernel.rng.random() < min(1.0, 4 * kernel.faults.crash_at(seam)):
            kernel.crash(actor.incarnation, f"at crash point {name} ({actor.name})")
            raise SimCrash
        kernel.seam(seam)

    def _sender(self, name: str):
        kernel = self.kernel

        def apply_async(args=(), kwargs=None, queue=None, countdown=None, **options) -> None:
            kernel.seam(f"send {name}")
            message = Message(next(self.message_ids), name, tuple(args), queue, kernel.now + (countdown or 0))
            if kernel.faults_on and kernel.rng.random() < kernel.faults.send_drop:
                kernel.note(f"broker dropped {name}{message.args}")
                return
            if kernel.faults_on and kernel.rng.random() < kernel.faults.send_delay:
                delay = kernel.rng.uniform(1, 1200)
                message.ready_at += delay
                kernel.note(f"broker delayed {name}{message.args} by {delay:.0f}s")
            self._put(message)
            if kernel.faults_on and kernel.rng.random() < kernel.faults.send_duplicate:
                kernel.note(f"broker duplicated {name}{message.args}")
                self._put(dataclasses.replace(message, id=next(self.message_ids),
                                              ready_at=message.ready_at + kernel.rng.uniform(0, 300)))

        return apply_async

    def _put(self, message: Message) -> None:
        self.kernel.broker.messages.append(message)
        self.kernel.schedule(message.ready_at - self.kernel.now, "deliver")

    # -- the run ------------------------------------------------------------------------------------

    def run(self) -> Outcome:
        from workers.sim.checker import check

        kernel = self.kernel
        kernel.lease_s = liveness.LEASE.total_seconds()
        with _quiet("tokenmill", "celery"), self.wired():
            from workers import tasks
            from workers.inprocess import cancel_job

            self.api = SimApi(kernel, self.sessions, MODEL, tasks.dispatch_job,
                              lambda job_id: cancel_job(self.sessions, job_id))
            kernel.schedule(API_CLEANUP_S, "cleanup")
            for plan in self.jobs:
                self._write_input(plan)
                kernel.schedule(plan.arrives_at, "arrival", plan)
                if plan.cancel_at is not None:
                    kernel.schedule(plan.cancel_at, "cancel", plan)
            for worker in [*range(self.workers), FRONT]:
                self._start(worker, 0)
            kernel.schedule(kernel.rng.uniform(0, SWEEP_INTERVAL_S), "sweep")
            kernel.schedule(FAULTS_FOR_S, "faults_off")
            for _ in range(kernel.rng.choice((0, 0, 1, 2))):
                kernel.schedule(kernel.rng.uniform(0, FAULTS_FOR_S), "flush")
            for _ in range(kernel.rng.choice((0, 0, 1))):
                kernel.schedule(kernel.rng.uniform(0, FAULTS_FOR_S), "outage", kernel.rng.choice((60.0, 600.0)))
            settled = self._loop()
            self._stop_all()
            violations = [] if settled else [
                f"invariant 3: jobs not terminal {SETTLE_BOUND_S / 3600:.0f} h (simulated) after the faults "
                f"stopped: {self._unfinished()}"]
            violations += self.lost_work + check(kernel, self.sessions, self.jobs, self.api)
            statuses = self._statuses()
        return Outcome(kernel.seed, violations, kernel.schedule_log, statuses, self.task_errors, kernel.now)

    def _loop(self) -> bool:
        kernel = self.kernel
        while kernel.events:
            at, _, kind, payload = kernel.events[0]
            if at > FAULTS_FOR_S + SETTLE_BOUND_S:
                return False
            if kind == "sweep" and self._arrivals_done() and self._settled():
                return True
            import heapq

            heapq.heappop(kernel.events)
            kernel.now = max(kernel.now, at)
            getattr(self, f"_on_{kind}")(payload)
            self._deliver()
        return self._settled()

    def _arrivals_done(self) -> bool:
        """No job is still to arrive or be cancelled: a run whose jobs all ended may stop before the faults do."""
        return all((plan.job_id is not None or plan.rejected) and (plan.cancel_at is None or
                                                                  plan.cancel_at <= self.kernel.now)
                   for plan in self.jobs)

    def _settled(self) -> bool:
        if any(plan.job_id is None and not plan.rejected for plan in self.jobs):
            return False
        if self.kernel.now < self.kernel.store_down_until:  # an outage still on: the cleanups it holds up wait
            return False
        if any(actor is not None for inc in self.kernel.incarnations if inc.alive for actor in inc.slots.values()):
            return False
        return not self._unfinished() and not self._cleanups_due()

    def _cleanups_due(self) -> bool:
        """A part recorded before its upload and not yet committed or removed, or removed and there again (an
        upload that landed late): the sweeps remove it (its own cleanup failed), as they do forever in a real
        fleet; the run goes on until they did."""
        from storage import repository as repo

        with self.sessions() as session:
            notes = repo.upload_notes(session)
        prefixes = {plan.job_id: normalize_uri(plan.output_uri) for plan in self.jobs if plan.job_id}
        return any(removed is None or key in self.kernel.objects.get(prefixes.get(owner, ""), {})
                   for owner, key, removed in notes)

    def _unfinished(self) -> dict[str, str]:
        from storage.states import is_terminal

        return {job: status for job, status in self._statuses().items() if not is_terminal(status)}

    def _statuses(self) -> dict[str, str]:
        with self.sessions() as session:
            by_id = {job.id: job.status for job in session.query(Job)}
        return {f"job {plan.index}": by_id[plan.job_id] for plan in self.jobs if plan.job_id in by_id}

    # -- events -------------------------------------------------------------------------------------

    def _on_deliver(self, payload) -> None:
        return None  # `_deliver` runs after every event

    def _on_resume(self, actor: Actor) -> None:
        incarnation = actor.incarnation
        if incarnation.alive and incarnation.paused_until > self.kernel.now:
            self.kernel.schedule(incarnation.paused_until - self.kernel.now, "resume", actor)
            return
        self._step(actor)

    def _on_beat(self, payload) -> None:
        incarnation, every_s, tick, stop = payload
        if stop.is_set() or not incarnation.alive:
            return
        if incarnation.paused_until > self.kernel.now:  # a paused process renews nothing
            self.kernel.schedule(incarnation.paused_until - self.kernel.now, "beat", payload)
            return
        _local.beating = incarnation
        try:
            tick()
        finally:
            _local.beating = None
        self.kernel.schedule(every_s, "beat", payload)

    def _on_sweep(self, payload) -> None:
        from workers import tasks

        if not self.kernel.faults_on:
            self._check_lost_work()
        self.kernel.schedule(SWEEP_INTERVAL_S, "sweep")
        candidates = [inc for inc in self._live() if inc.slots["beat"] is None]
        if candidates:
            incarnation = self.kernel.rng.choice(candidates)
            self._begin(incarnation, "beat", "sweep", lambda: tasks.app.tasks["tokenmill.sweep"](), None)

    def _faults_over_at(self) -> float:
        """When the last fault's effect ended: a pause or an outage drawn before the faults stopped may outlast
        the stop (a process paused inside a SQLite write transaction holds every other writer, the sweep too)."""
        paused = max((inc.paused_until for inc in self.kernel.incarnations if inc.alive), default=0.0)
        return max(FAULTS_FOR_S, self.kernel.store_down_until, paused)

    def _check_lost_work(self) -> None:
        """Invariant 7, once the faults stopped: a shard waiting for a task (pending, or failed and to be retried)
        has one in the broker (due within the grace), or running on a live worker, or the sweep sends one within
        `LOST_WORK_S`."""
        from storage.models import Shard, ShardStatus

        now, horizon = self.kernel.now, self.kernel.now + SWEEP_GRACE_S
        tasked = {m.args[1] for m in self.kernel.broker.messages
                  if m.task == "tokenmill.run_shard" and m.ready_at <= horizon}
        tasked |= {actor.message.args[1] for inc in self._live() if (actor := inc.slots["gpu"]) and actor.message}
        with self.sessions() as session:
            waiting = session.execute(select(Shard.id, Shard.index, Job.id).join(Job).where(
                Shard.status.in_([ShardStatus.PENDING.value, ShardStatus.FAILED.value]),
                Job.status.in_(["queued", "in_progress"]))).all()
        names = {plan.job_id: plan.index for plan in self.jobs}
        still = set()
        for shard_id, index, job_id in waiting:
            if shard_id in tasked:
                continue
            still.add(shard_id)
            since = self.lost_since.setdefault(shard_id, now)
            if now - max(since, self._faults_over_at()) > LOST_WORK_S and since >= 0:
                self.lost_work.append(f"invariant 7: job {names.get(job_id, job_id)}: shard {index} has waited with "
                                      f"no task since t={since:.0f}s (over {LOST_WORK_S:.0f} s, the faults over)")
                self.lost_since[shard_id] = -1.0  # reported
        for shard_id in set(self.lost_since) - still:
            if self.lost_since[shard_id] >= 0:
                del self.lost_since[shard_id]

    def _on_arrival(self, plan: JobPlan) -> None:
        from ingest.intake import Intake
        from ingest.job_request import JobRequest, JobRequestError
        from workers import tasks

        if plan.api:  # a request to the API's process, which may crash or fail in it like any worker
            front = self._front()
            if front is None or front.slots["api"] is not None:
                self.kernel.schedule(5, "arrival", plan)
                return
            self._begin(front, "api", "create_batch", lambda: self._create_batch(plan), None)
            return

        request = JobRequest(job_id=uuid.uuid5(uuid.NAMESPACE_URL, f"tokenmill-sim/{self.kernel.seed}/{plan.index}"),
                             input_uri=plan.input_uri, output_uri=plan.output_uri, model=MODEL,
                             shard_size=plan.shard_size, completion_window=plan.window,
                             openai_output=plan.openai_output)
        intake = Intake(self.sessions, S3Options(), tasks.dispatch_job)
        try:
            submission = intake.accept(request, source="cli", source_ref=f"sim-{plan.index}",
                                       default_key=f"sim-{self.kernel.seed}-{plan.index}")
        except JobRequestError as error:  # e.g. its output prefix belongs to a live job
            if plan.prefix_of is not None and "taken by live job" in str(error) and \
                    self.kernel.now < plan.arrives_at + PREFIX_WAIT_S:  # its client waits for the prefix
                self.kernel.schedule(self.kernel.rng.uniform(5, 60), "arrival", plan)
                return
            plan.rejected = str(error)
            self.kernel.note(f"job {plan.index} refused: {error}")
            return
        plan.job_id, plan.arrived_at = submission.job.id, self.kernel.now

    def _create_batch(self, plan: JobPlan) -> None:
        from ingest.openai_api.objects import ApiError

        plan.requested_at = self.kernel.now
        try:
            plan.job_id = self.api.create(plan, self.api.upload(plan, self._rows(plan)))
        except SimCrash:
            plan.rejected = "the API's process died during the request"
            raise
        except ApiError as error:
            plan.rejected = str(error)
            self.kernel.note(f"batch {plan.index} refused: {error}")
            return
        except Exception as error:  # the client sees a 500
            plan.rejected = f"{type(error).__name__}: {error}"
            self.kernel.note(f"batch {plan.index}: the API failed the request ({type(error).__name__})")
            return
        plan.arrived_at = self.kernel.now
        self.kernel.schedule(API_POLL_S, "poll", plan)

    def _on_cancel(self, plan: JobPlan) -> None:
        """A cancel request, handled in the API's process (which may pause or die in it, its cleanup too)."""
        if plan.job_id is None:
            if not plan.rejected:
                self.kernel.schedule(60, "cancel", plan)
            return
        front = self._front()
        if front is None or front.slots["api"] is not None:
            self.kernel.schedule(5, "cancel", plan)
            return
        self._begin(front, "api", "cancel", lambda: self._cancel(plan), None)

    def _cancel(self, plan: JobPlan) -> None:
        from workers.inprocess import cancel_job

        try:
            if plan.api:
                self.api.cancel(plan.job_id)
                self.kernel.note(f"cancel batch {plan.index}")
                return
            cancel_job(self.sessions, plan.job_id)
            self.kernel.note(f"cancel job {plan.index}")
        except ValueError:
            pass  # no longer cancellable
        except SimCrash:  # the client sees its request fail, and sends it again
            self.kernel.schedule(30, "cancel", plan)
            raise
        except Exception as error:
            if not is_transient(error):
                raise
            self.kernel.schedule(30, "cancel", plan)

    def _on_poll(self, plan: JobPlan) -> None:
        try:
            if self.api.poll(plan.job_id):
                return
        except Exception as error:  # the checker polls again, and reports what it raises
            self.kernel.note(f"poll of batch {plan.index} raised {type(error).__name__}")
        self.kernel.schedule(API_POLL_S, "poll", plan)

    def _on_cleanup(self, payload) -> None:
        self.api.cleanup()
        if not (self._arrivals_done() and self.kernel.now > FAULTS_FOR_S):
            self.kernel.schedule(API_CLEANUP_S, "cleanup")

    def _on_flush(self, payload) -> None:
        self.kernel.broker.flush()
        self.kernel.note("broker flushed (queues and marker lost)")

    def _on_outage(self, seconds: float) -> None:
        self.kernel.store_down_until = self.kernel.now + seconds
        self.kernel.note(f"object store down for {seconds:.0f}s")

    def _on_faults_off(self, payload) -> None:
        self.kernel.faults_on = False
        self.kernel.note("faults stop")

    def _on_restart(self, incarnation: Incarnation) -> None:
        self._start(incarnation.worker, incarnation.generation + 1)

    # -- workers and their tasks --------------------------------------------------------------------

    def _start(self, worker: int, generation: int) -> None:
        """A worker's process (`worker` >= 0), or the API's (`FRONT`)."""
        host = self.worker_host[worker] if worker != FRONT else self.kernel.front_host
        identity = liveness.WorkerIdentity(host, 100 + generation, "", "", f"s{self.kernel.seed}w{worker}g{generation}")
        incarnation = Incarnation(worker, generation, host, identity)
        self.kernel.incarnations.append(incarnation)

    def _live(self) -> list[Incarnation]:
        """The workers' processes that are up."""
        return [inc for inc in self.kernel.incarnations if inc.alive and inc.worker != FRONT]

    def _front(self) -> Incarnation | None:
        return next((inc for inc in self.kernel.incarnations if inc.alive and inc.worker == FRONT), None)

    def _deliver(self) -> None:
        kernel = self.kernel
        from workers import tasks

        for incarnation in self._live():
            if incarnation.paused_until > kernel.now:
                continue
            for slot in ("control", "gpu"):
                if incarnation.slots[slot] is not None or not incarnation.alive:
                    continue
                wanted = [m for m in kernel.broker.messages if SLOT_OF[m.task] == slot and m.ready_at <= kernel.now]
                if not wanted:
                    continue
                message = kernel.rng.choice(wanted) if kernel.faults.reorder and kernel.faults_on else wanted[0]
                kernel.broker.messages.remove(message)
                task = tasks.app.tasks[message.task]
                self._begin(incarnation, slot, message.task.split(".")[1], lambda t=task, m=message: t(*m.args),
                            message)

    def _begin(self, incarnation: Incarnation, slot: str, name: str, work, message: Message | None) -> None:
        actor = Actor(self.kernel, incarnation, slot, name, work, message)
        incarnation.slots[slot] = actor
        self._step(actor)

    def _step(self, actor: Actor) -> None:
        actor.step()
        if actor.finished:
            self._finished(actor)

    def _finished(self, actor: Actor) -> None:
        actor.thread.join()
        incarnation, message, kernel = actor.incarnation, actor.message, self.kernel
        if incarnation.slots.get(actor.slot) is actor:
            incarnation.slots[actor.slot] = None
        if actor.name == "sweep" and isinstance(actor.result, dict):
            for plan in self.jobs:
                if plan.job_id in actor.result.get("expired", ()) and plan.expired_at is None:
                    plan.expired_at = kernel.now
        if actor.crashed:
            if message is not None:  # unacknowledged: the broker hands it out again after the visibility timeout
                self._put(dataclasses.replace(message, ready_at=kernel.now + VISIBILITY_S))
            return
        if actor.error is None:
            return
        if message is not None and is_transient(actor.error):  # the task retries (Celery's self.retry)
            self._put(dataclasses.replace(message, ready_at=kernel.now + RETRY_S))
            return
        self.task_errors.append(f"t={kernel.now:.0f}s {actor.name} on {incarnation}: "
                                f"{type(actor.error).__name__}: {str(actor.error)[:200]}")

    def _stop_all(self) -> None:
        """End every simulated process (the run is over): parked tasks unwind, writing nothing."""
        self.kernel.faults_on = False
        for incarnation in self.kernel.incarnations:
            incarnation.alive = False
        for incarnation in self.kernel.incarnations:
            for actor in list(incarnation.slots.values()):
                while actor is not None and not actor.finished:
                    actor.step()
                if actor is not None:
                    actor.thread.join()
            incarnation.slots = dict.fromkeys(incarnation.slots)

    @staticmethod
    def _rows(plan: JobPlan) -> list[tuple[str, str | None]]:
        """(custom_id, prompt); a row in seven has none (it fails alone, into the error file)."""
        return [(custom_id, None if row % 7 == 5 else f"prompt {custom_id}")
                for row, custom_id in enumerate(plan.custom_ids)]

    def _write_input(self, plan: JobPlan) -> None:
        if plan.api:
            return  # uploaded when it arrives
        ids = plan.custom_ids
        prompts = [prompt for _, prompt in self._rows(plan)]
        buffer = io.BytesIO()
        pq.write_table(pa.table({"custom_id": ids, "prompt": pa.array(prompts, pa.string())}), buffer)
        store = self.kernel.store(f"{BUCKET}/inbox")
        store.objects[f"job-{plan.index}.parquet"] = (buffer.getvalue(), next(self.kernel.versions))


_MISSING = object()


@contextlib.contextmanager
def _quiet(*names: str) -> Iterator[None]:
    """The job code's warnings are the faults working as meant: not printed while a run goes."""
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)




def _checkin(dbapi_connection, record) -> None:
    actor = record.info.pop("sim_actor", None)
    if actor is not None:
        actor.connections -= 1
