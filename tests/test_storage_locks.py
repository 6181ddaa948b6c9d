"""The budget lock of each storage (search/storage/schemes.py `budget_lock`, one row per scheme): mutual exclusion,
a live holder keeps its lock past the silence limit, and a dead holder's lock is broken after it; and (issue 38) the
lock itself behaving under faults: a holder never removes another's lock file, a stale one is broken once, a
database session ended under a holder or a waiter is no traceback, session timeouts, symlinks, unwritable lock files,
Optuna's own journal lock left by a killed writer, a frozen Redis. The whole searches with `--workers 2` on each
storage are in test_search.py; every row of the table, an unknown scheme and a registered one in
test_storage_schemes.py."""
import os
import threading
import time
import uuid
import zlib
from pathlib import Path
from typing import Iterator

import pytest

from headsearch.search import storage
from headsearch.search.storage import budget_lock, timings
from test_search import shared_storage

KINDS = ["sqlite", "postgresql", "mysql", "journal", "redis"]


@pytest.mark.floor
@pytest.mark.parametrize("kind", KINDS)
def test_the_budget_lock_lets_one_holder_in_at_a_time(kind, request, tmp_path):
    """Four threads each add 1 to a counter 25 times, reading and writing it in two steps under the lock
    with a pause between: any overlap loses an update."""
    url, study = shared_storage(kind, request, tmp_path)[0], f"lock-{uuid.uuid4().hex[:8]}"
    counter = tmp_path / "counter"
    counter.write_text("0")

    def add() -> None:
        for _ in range(25):
            with budget_lock(url, study):
                n = int(counter.read_text())
                time.sleep(0.0005)
                counter.write_text(str(n + 1))

    threads = [threading.Thread(target=add) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert int(counter.read_text()) == 100


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["journal", "redis"])
def test_a_live_holder_keeps_the_lock_and_a_dead_ones_lock_is_broken(kind, request, tmp_path, monkeypatch):
    """With a 1.5 s silence limit renewed every 0.2 s: a holder that keeps the lock for 2.5 s keeps it to the
    end (the waiter gets it only after release), and a lock nobody renews (its worker was killed) is taken
    about 1.5 s later, not never."""
    monkeypatch.setattr(timings, "LOCK_SILENCE", 1.5)
    monkeypatch.setattr(timings, "LOCK_RENEW", 0.2)
    url, study = shared_storage(kind, request, tmp_path)[0], f"lock-{uuid.uuid4().hex[:8]}"
    events: list[tuple[str, float]] = []
    held = threading.Event()

    def holder() -> None:
        with budget_lock(url, study):
            held.set()
            time.sleep(2.5)
            events.append(("released", time.monotonic()))

    thread = threading.Thread(target=holder)
    thread.start()
    held.wait(10)
    with budget_lock(url, study):
        events.append(("taken", time.monotonic()))
    thread.join()
    assert [e for e, _ in events] == ["released", "taken"]

    # A dead holder: the lock exists and nobody renews it.
    if kind == "journal":
        Path(str(tmp_path / "h.log") + ".budget.lock").touch()
    else:
        import redis

        redis.Redis.from_url(url).set(f"headsearch:budget:{study}", "dead-worker", px=1500)
    start = time.monotonic()
    with budget_lock(url, study):
        waited = time.monotonic() - start
    assert 1.2 <= waited <= 6, waited


# -- issue 38: the lock itself behaves (a holder never removes another's lock, a stale lock is broken once,
# a database session ended under a holder or a waiter is no traceback, symlinks, timeouts, permissions) ---


class Worker(threading.Thread):
    """Runs `fn` in a daemon thread, keeping what it returned or raised."""

    def __init__(self, fn):
        super().__init__(daemon=True)
        self.fn, self.result, self.error = fn, None, None

    def run(self) -> None:
        try:
            self.result = self.fn()
        except BaseException as e:  # noqa: BLE001  (the test reads it)
            self.error = e


def holding(url: str, study: str, inside: threading.Event, leave: threading.Event, holds: dict, name: str) -> Worker:
    """A worker that takes the budget lock, says so (`inside`) and keeps it until `leave`."""
    def run() -> None:
        with budget_lock(url, study) as hold:
            holds[name] = hold
            inside.set()
            leave.wait(30)

    worker = Worker(run)
    worker.start()
    return worker


def with_query(url: str, **params: str) -> str:
    from urllib.parse import quote, urlencode

    return url + ("&" if "?" in url else "?") + urlencode(params, quote_via=quote)


def test_a_holder_whose_lock_was_broken_leaves_its_successors_lock(tmp_path, monkeypatch, caplog):
    """Issue 38 row 2. Holder A stops renewing (a pause past the silence limit: here nobody renews), so waiter
    B breaks its lock and enters. When A leaves, the lock file is B's and stays there (A used to remove it by
    path): a third worker C stays out while B is inside, and A knows that it lost the lock."""
    monkeypatch.setattr(timings, "LOCK_SILENCE", 1.0)
    monkeypatch.setattr(timings, "LOCK_RENEW", 60.0)
    url, holds = f"journal:{tmp_path / 'h.log'}", {}
    lock_file = Path(str(tmp_path / "h.log") + ".budget.lock")
    a_in, a_out, b_in, b_out, c_in, c_out = (threading.Event() for _ in range(6))
    a = holding(url, "s", a_in, a_out, holds, "a")
    assert a_in.wait(10)
    b = holding(url, "s", b_in, b_out, holds, "b")
    assert b_in.wait(10)  # after about 1 s: A's lock was broken
    a_out.set()
    a.join(10)
    assert a.error is None, a.error
    assert holds["a"].lost and not holds["b"].lost
    assert "lost while held" in caplog.text
    assert lock_file.exists()  # B's
    c_out.set()
    c = holding(url, "s", c_in, c_out, holds, "c")
    assert not c_in.wait(0.5)  # B is inside (C could break B's unrenewed lock only after 1 s)
    b_out.set()
    assert c_in.wait(10)
    for worker in (b, c):
        worker.join(10)
        assert worker.error is None, worker.error
    assert not holds["b"].lost and not lock_file.exists()


@pytest.mark.slow
def test_waiters_that_judge_the_same_lock_stale_let_one_in(tmp_path, monkeypatch):
    """Issue 38 row 3. A dead worker's lock file (nobody renews it) and four waiters released together by a
    barrier, in 8 rounds: they all judge it stale at about the same moment, and exactly one may enter at a
    time. Each look at the lock file is followed by a random pause of up to 3 ms, so a waiter acts on what it
    saw a little late (what let two waiters each remove "the stale file", the second removing the first's
    new lock)."""
    monkeypatch.setattr(timings, "LOCK_SILENCE", 0.3)
    monkeypatch.setattr(timings, "LOCK_RENEW", 0.05)
    import os
    import random

    def late(real):
        def look(path, *args, **kwargs):
            result = real(path, *args, **kwargs)
            if ".budget.lock" in str(path):
                time.sleep(random.uniform(0, 0.003))
            return result
        return look

    monkeypatch.setattr(os, "stat", late(os.stat))
    monkeypatch.setattr(os, "lstat", late(os.lstat))
    url, lock_file = f"journal:{tmp_path / 'h.log'}", Path(str(tmp_path / "h.log") + ".budget.lock")
    count, inside, most = threading.Lock(), [0], [0]

    def enter(barrier: threading.Barrier) -> None:
        barrier.wait(10)
        with budget_lock(url, "s"):
            with count:
                inside[0] += 1
                most[0] = max(most[0], inside[0])
            time.sleep(0.005)
            with count:
                inside[0] -= 1

    for _ in range(8):  # two waiters got in within the first three rounds, before the fix
        lock_file.write_text("dead-host:1:0\n")
        barrier = threading.Barrier(4)
        workers = [Worker(lambda: enter(barrier)) for _ in range(4)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(20)
            assert w.error is None, w.error
        assert most[0] == 1, f"{most[0]} waiters inside at once"
    assert not lock_file.exists() and not list(tmp_path.glob("*.aside")) and not list(tmp_path.glob("*.break"))


@pytest.mark.parametrize("kind", ["sqlite", "journal"])
def test_a_symlink_to_the_same_file_takes_the_same_lock(kind, tmp_path):
    """Issue 38 row 11. The lock file is named after the real path: a holder through a symlink excludes a
    worker that names the file itself."""
    real = tmp_path / "real" / ("h.db" if kind == "sqlite" else "h.log")
    link = tmp_path / "link" / real.name
    real.parent.mkdir()
    link.parent.mkdir()
    real.touch()
    link.symlink_to(real)
    url = (lambda p: f"sqlite:///{p}") if kind == "sqlite" else (lambda p: f"journal:{p}")
    events: list[str] = []
    inside, leave = threading.Event(), threading.Event()
    holder = holding(url(link), "s", inside, leave, {}, "link")
    assert inside.wait(10)
    threading.Timer(0.5, lambda: (events.append("released"), leave.set())).start()
    with budget_lock(url(real), "s"):
        events.append("taken")
    holder.join(10)
    assert events == ["released", "taken"]
    assert not (link.parent / (real.name + ".budget.lock")).exists()


@pytest.mark.parametrize("kind", ["sqlite", "journal"])
@pytest.mark.parametrize("fault", ["permission", "parent is a file"])
def test_a_lock_file_that_cannot_be_written_is_one_line(kind, fault, tmp_path, monkeypatch):
    """Issue 38 row 9: a lock file another user left (not writable by us) or a read-only folder. Tests run as
    root, whom permission bits do not stop: `os.open` refuses the lock file (fault injection at the system
    call), or, a real fault even for root, the folder of the storage is a regular file."""
    import errno
    import os

    from headsearch.errors import HeadsearchError

    folder = tmp_path
    if fault == "parent is a file":
        folder = tmp_path / "file"
        folder.write_text("")
        why = "Not a directory"
    else:
        real_open = os.open

        def refuse(path, flags, *args, **kwargs):
            if str(path).endswith(".budget.lock"):
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
            return real_open(path, flags, *args, **kwargs)

        monkeypatch.setattr(os, "open", refuse)
        why = "Permission denied"
    target = folder / ("h.db" if kind == "sqlite" else "h.log")
    url = f"sqlite:///{target}" if kind == "sqlite" else f"journal:{target}"
    with pytest.raises(HeadsearchError) as e:
        with budget_lock(url, "s"):
            pytest.fail("entered without a lock")
    message = str(e.value)
    assert "\n" not in message and f"{target}.budget.lock" in message and why in message, message


def test_an_sqlite_lock_file_another_user_left_still_locks(tmp_path, monkeypatch):
    """flock needs no write access: a lock file we may not open for writing is locked read-only."""
    import os

    (tmp_path / "h.db.budget.lock").touch()
    real_open = os.open

    def read_only(path, flags, *args, **kwargs):
        if str(path).endswith(".budget.lock") and flags & (os.O_WRONLY | os.O_RDWR):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", read_only)
    with budget_lock(f"sqlite:///{tmp_path / 'h.db'}", "s") as hold:
        assert not hold.lost


@pytest.mark.floor
@pytest.mark.parametrize("left, reached", [("symlink", "directly"), ("file", "through a symlink")])
def test_optunas_own_lock_left_by_a_killed_writer_is_broken(left, reached, tmp_path, monkeypatch):
    """Issue 38 row 6: a worker killed while appending to a journal leaves Optuna's FILE.log.lock behind (a
    symlink: Optuna's default JournalFileSymlinkLock; a file: JournalFileOpenLock). On Optuna 4.0 every later
    write waited for it forever; it is broken after the silence limit, and through a symlink to the journal
    it is the same lock (the write waits for it first)."""
    import os

    import optuna

    from headsearch.search.storage import open_storage

    monkeypatch.setattr(timings, "LOCK_SILENCE", 1.0)
    real = tmp_path / "real" / "h.log"
    real.parent.mkdir()
    real.touch()
    opened = real
    if reached == "through a symlink":
        opened = tmp_path / "h.log"
        opened.symlink_to(real)
    stale = Path(str(real) + ".lock")
    if left == "symlink":
        stale.symlink_to(real)
    else:
        stale.write_text("")
    os.utime(stale, (1e9, 1e9), follow_symlinks=False)

    def write() -> float:
        study = optuna.create_study(storage=open_storage(f"journal:{opened}", heartbeat=None), study_name="s")
        study.tell(study.ask(), 1.0)
        return time.monotonic()

    start = time.monotonic()
    worker = Worker(write)
    worker.start()
    worker.join(15)
    assert not worker.is_alive(), "still waiting for Optuna's lock after 15 s"
    assert worker.error is None, worker.error
    assert worker.result - start >= 0.9  # it waited for that lock: the same one
    assert not os.path.lexists(stale)
    assert len(optuna.load_study(study_name="s", storage=open_storage(f"journal:{real}", heartbeat=None)).trials) == 1


# -- PostgreSQL and MySQL: the lock's session ended by the server, session timeouts --------------------------


def admin(url: str):
    import sqlalchemy as sa

    return sa.create_engine(storage.normalize_url(url), poolclass=sa.pool.NullPool, isolation_level="AUTOCOMMIT")


def wait_for(probe, what: str, timeout: float = 10):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (found := probe()):
            return found
        time.sleep(0.05)
    pytest.fail(f"no {what} after {timeout} s")


def end_session(kind: str, url: str, key: int, granted: bool) -> None:
    """End, from another connection, the database session holding (granted) or awaiting the budget lock `key`."""
    import sqlalchemy as sa

    engine = admin(url)
    with engine.connect() as c:
        if kind == "postgresql":
            pid = wait_for(lambda: c.execute(sa.text(
                "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND objid::bigint = :k AND granted = :g"),
                {"k": key, "g": granted}).scalar(), "session on the lock")
            assert c.execute(sa.text("SELECT pg_terminate_backend(:p)"), {"p": pid}).scalar()
        else:
            if granted:
                found = lambda: c.execute(sa.text("SELECT IS_USED_LOCK(:k)"), {"k": str(key)}).scalar()  # noqa: E731
            else:
                found = lambda: c.execute(sa.text(  # noqa: E731
                    "SELECT ID FROM information_schema.PROCESSLIST WHERE INFO LIKE 'SELECT GET_LOCK(%' AND INFO LIKE :p"),
                    {"p": f"%'{key}'%"}).scalar()
            c.execute(sa.text(f"KILL {int(wait_for(found, 'session on the lock'))}"))
    engine.dispose()


@pytest.mark.parametrize("kind", ["postgresql", "mysql"])
def test_a_lock_session_ended_by_the_server_during_the_hold_is_no_traceback(kind, request, caplog):
    """Issue 38 row 4: pg_terminate_backend / KILL of the lock's connection while a worker is inside. The
    server released the lock with the session: the holder leaves its block without an error (it used to
    crash at unlock), knows it lost the lock, and the next worker takes it."""
    url, study = request.getfixturevalue(f"{'pg' if kind == 'postgresql' else 'mysql'}_url"), f"lock-{uuid.uuid4().hex[:8]}"
    key = zlib.crc32(f"headsearch:{study}".encode())
    inside, leave, holds = threading.Event(), threading.Event(), {}
    holder = holding(url, study, inside, leave, holds, "h")
    assert inside.wait(10)
    end_session(kind, url, key, granted=True)
    leave.set()
    holder.join(10)
    assert holder.error is None, holder.error
    assert holds["h"].lost and "ended its session" in holds["h"].reason
    assert "lost while held" in caplog.text
    with budget_lock(url, study) as hold:
        assert not hold.lost


@pytest.mark.parametrize("kind", ["postgresql", "mysql"])
def test_a_waiter_whose_session_is_ended_waits_again(kind, request):
    """Issue 38 row 4: the server ends the session of a worker waiting for the lock (a restart, a kill): it
    opens a new one and waits again, and enters after the holder, without an error."""
    url, study = request.getfixturevalue(f"{'pg' if kind == 'postgresql' else 'mysql'}_url"), f"lock-{uuid.uuid4().hex[:8]}"
    key = zlib.crc32(f"headsearch:{study}".encode())
    events: list[str] = []
    inside, leave, holds = threading.Event(), threading.Event(), {}
    holder = holding(url, study, inside, leave, holds, "h")
    assert inside.wait(10)

    def wait() -> None:
        with budget_lock(url, study):
            events.append("taken")

    waiter = Worker(wait)
    waiter.start()
    end_session(kind, url, key, granted=False)
    time.sleep(0.5)
    events.append("released")
    leave.set()
    for w in (holder, waiter):
        w.join(15)
        assert w.error is None, w.error
    assert events == ["released", "taken"] and not holds["h"].lost


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["postgresql", "mysql"])
def test_session_timeouts_neither_end_a_hold_nor_a_wait(kind, request):
    """Issue 38 row 4: the user's session settings (PGOPTIONS, init_command; here in the URL) end an idle
    session after 1 s, or a statement after 0.3 s. The holder keeps the lock for 2 s idle, and a waiter
    waits those 2 s for it: the lock connection turns those timeouts off."""
    import sqlalchemy as sa

    url, study = request.getfixturevalue(f"{'pg' if kind == 'postgresql' else 'mysql'}_url"), f"lock-{uuid.uuid4().hex[:8]}"
    engine = admin(url)
    with engine.connect() as c:
        if kind == "postgresql":
            idle = "-c idle_in_transaction_session_timeout=1000"
            if c.execute(sa.text("SHOW server_version_num")).scalar() >= "140000":
                idle += " -c idle_session_timeout=1000"
            holder_url, waiter_url = with_query(url, options=idle), with_query(url, options="-c statement_timeout=300")
        else:
            mariadb = "mariadb" in c.execute(sa.text("SELECT VERSION()")).scalar().lower()
            limit = "max_statement_time=0.3" if mariadb else "max_execution_time=300"
            holder_url = with_query(url, init_command="SET SESSION wait_timeout=1")
            waiter_url = with_query(url, init_command=f"SET SESSION {limit}")
    engine.dispose()
    events: list[str] = []
    inside, leave, holds = threading.Event(), threading.Event(), {}
    holder = holding(holder_url, study, inside, leave, holds, "h")
    assert inside.wait(10)
    threading.Timer(2.0, lambda: (events.append("released"), leave.set())).start()
    with budget_lock(waiter_url, study) as hold:
        events.append("taken")
    holder.join(10)
    assert holder.error is None, holder.error
    assert events == ["released", "taken"] and not holds["h"].lost and not hold.lost


# -- Redis: socket timeouts on every client headsearch makes ---------------------------------------------------


@pytest.fixture
def frozen_redis(tmp_path) -> Iterator[str]:
    """The URL of a private Redis server, stopped (SIGSTOP): it accepts connections and never answers."""
    import shutil
    import signal
    import socket
    import subprocess

    from conftest import unavailable

    if shutil.which("redis-server") is None:
        unavailable("redis-server is not installed")
    pytest.importorskip("redis")
    import redis

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        def up() -> bool:
            try:
                return redis.Redis.from_url(url, socket_timeout=1, socket_connect_timeout=1).ping()
            except redis.exceptions.ConnectionError:
                return False

        wait_for(up, "redis-server answering")
        proc.send_signal(signal.SIGSTOP)
        yield url
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.processes
@pytest.mark.floor
def test_a_frozen_redis_fails_the_lock_and_the_storage_instead_of_hanging(frozen_redis, monkeypatch):
    """Issue 38 row 12: redis-py up to 7 has no socket timeout by default, so a frozen Redis hung the search.
    With 1 s timeouts, taking the budget lock and opening the storage each fail within seconds, in one line."""
    from headsearch.errors import HeadsearchError
    from headsearch.search.storage import open_storage

    monkeypatch.setattr(timings, "REDIS_TIMEOUT", 1)
    monkeypatch.setattr(timings, "REDIS_CONNECT_TIMEOUT", 1)

    def lock() -> None:
        with budget_lock(frozen_redis, "s"):
            pass

    for attempt in (lock, lambda: open_storage(frozen_redis, heartbeat=None)):
        start = time.monotonic()
        worker = Worker(attempt)
        worker.start()
        worker.join(8)
        assert not worker.is_alive(), "still waiting for the frozen Redis after 8 s"
        assert isinstance(worker.error, HeadsearchError), worker.error
        assert "\n" not in str(worker.error) and time.monotonic() - start < 8


@pytest.mark.floor
def test_every_redis_client_headsearch_makes_has_socket_timeouts(redis_url, monkeypatch):
    """Issue 38 row 12: the budget lock's client and Optuna's JournalRedisBackend's (which takes only a URL,
    also after a pickle round trip: a worker process) time out, keeping any timeout the URL sets itself."""
    import pickle

    import redis

    from headsearch.search.storage import open_storage, redis_url_with_timeouts

    monkeypatch.setattr(timings, "REDIS_TIMEOUT", 7)
    clients = []
    real_from_url = redis.Redis.from_url.__func__

    def from_url(cls, url, **kwargs):
        clients.append(real_from_url(cls, url, **kwargs))
        return clients[-1]

    monkeypatch.setattr(redis.Redis, "from_url", classmethod(from_url))
    with budget_lock(redis_url, f"lock-{uuid.uuid4().hex[:8]}"):
        pass
    store = open_storage(redis_url, heartbeat=None)
    pickle.loads(pickle.dumps(store))
    assert len(clients) == 3
    for client in clients:
        options = client.connection_pool.connection_kwargs
        assert options["socket_timeout"] == 7 and options["socket_connect_timeout"] == timings.REDIS_CONNECT_TIMEOUT
    assert "socket_timeout=2" in redis_url_with_timeouts(redis_url + "?socket_timeout=2")
    assert redis_url_with_timeouts(redis_url + "?socket_timeout=2").count("socket_timeout=") == 1


@pytest.mark.parametrize("kind", ["postgresql", "mysql"])
def test_a_lock_connection_probes_a_silent_peer_within_a_minute(kind, request):
    """Row 13: a holder whose host loses power keeps its session (and so its lock) until TCP notices; with the
    system's keepalive timings that is about two hours. The lock connection probes after 30 s idle, every 10 s,
    3 times: the server drops a dead holder's session, and its lock with it, within about a minute."""
    import socket

    url = request.getfixturevalue("pg_url" if kind == "postgresql" else "mysql_url")
    engine = storage.server_locks._lock_engine(storage.normalize_url(url))
    try:
        with engine.connect() as conn:
            raw = conn.connection.dbapi_connection
            if kind == "postgresql":
                params = raw.get_dsn_parameters()
                assert (params["keepalives"], params["keepalives_idle"], params["keepalives_interval"],
                        params["keepalives_count"]) == ("1", "30", "10", "3")
                sock = socket.socket(fileno=os.dup(raw.fileno()))
            else:
                sock = raw._sock
            try:
                assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 30
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL) == 10
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == 3
            finally:
                if kind == "postgresql":
                    sock.detach()
    finally:
        engine.dispose()
