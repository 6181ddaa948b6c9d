"""The locks on storage servers: a Redis lock for a Redis journal (`_redis_lock`), and PostgreSQL's advisory
lock or MySQL's GET_LOCK for a database (`_db_lock`: the budget lock, and the schema lock held while Optuna creates
its tables), each on a connection made to last while held. The lock files of the file storages are in `locks`."""
from __future__ import annotations

import contextlib
import logging
import socket
import time
from typing import Iterator

# The timings (LOCK_SILENCE, REDIS_TIMEOUT, ...) are read at each use, never copied: a test or worker script sets them.
import headsearch.search.storage.timings as timings
from headsearch.errors import HeadsearchError
from headsearch.search.storage.locks import LockHold, _renewing

_log = logging.getLogger(__name__)


# -- Redis ----------------------------------------------------------------------------------------------


def redis_url_with_timeouts(url: str) -> str:
    """`url` with socket timeouts and keepalives as query parameters, unless it sets its own: redis-py has no
    socket timeout by default (up to 7 at least), so a frozen Redis would hang a worker in any command.
    Optuna's JournalRedisBackend takes only a URL, and redis-py's `from_url` reads these from it."""
    from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query, keep_blank_values=True))
    for name, value in (("socket_timeout", timings.REDIS_TIMEOUT),
                        ("socket_connect_timeout", timings.REDIS_CONNECT_TIMEOUT),
                        ("socket_keepalive", "true"), ("health_check_interval", 30)):
        query.setdefault(name, str(value))
    return urlunsplit(parts._replace(query=urlencode(query)))


@contextlib.contextmanager
def _redis_lock(url: str, study_name: str) -> Iterator[LockHold]:
    """The budget lock `headsearch:budget:STUDY` in the journal's own Redis: it expires LOCK_SILENCE seconds after
    its last renewal. A Redis that does not answer within REDIS_TIMEOUT seconds is one HeadsearchError line."""
    import redis

    name = f"headsearch:budget:{study_name}"
    client = redis.Redis.from_url(redis_url_with_timeouts(url))
    hold = LockHold(f"{name} in {url}")
    # thread_local=False: the renewing thread must see the token the acquiring thread got.
    lock = client.lock(name, timeout=timings.LOCK_SILENCE, sleep=0.01, thread_local=False)
    try:
        try:
            lock.acquire(blocking=True)
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as e:
            raise HeadsearchError(f"budget lock in Redis {url}: {e or type(e).__name__}: check that the server runs"
                                  f" and answers (each command waits {timings.REDIS_TIMEOUT} s at most)") from None

        def renew() -> bool:
            try:
                lock.reacquire()
            except redis.exceptions.LockNotOwnedError:
                hold.lose(f"it expired (not renewed for {timings.LOCK_SILENCE} s: this worker was paused or Redis"
                          " unreachable) and another worker may hold it")
                return False
            return True

        try:
            with _renewing(renew):
                yield hold
        finally:
            try:
                lock.release()
            except redis.exceptions.LockError:  # expired while held (a pause beyond LOCK_SILENCE)
                hold.lose(f"it expired (not renewed for {timings.LOCK_SILENCE} s) and another worker may hold it")
            except redis.exceptions.RedisError as e:
                _log.warning("headsearch: could not release the budget lock %s (%s): it expires by itself"
                             " after %s s", hold.what, e, timings.LOCK_SILENCE)
    finally:
        with contextlib.suppress(Exception):
            client.close()

# -- PostgreSQL and MySQL -----------------------------------------------------------------------------------


def _db_error_line(e: BaseException) -> str:
    text = str(getattr(e, "orig", None) or e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _lock_engine(url: str):
    """An engine for lock connections: autocommit, TCP keepalives (psycopg: libpq's keepalives parameters; PyMySQL: the
    socket's options once connected; mysqlclient has no way to set them, the system's timings apply) and a
    connect timeout, unless the URL sets its own."""
    import sqlalchemy as sa

    u = sa.engine.make_url(url)
    driver = u.get_dialect().driver
    args: dict = {}
    if driver in ("psycopg2", "psycopg"):
        args = {k: v for k, v in {**timings.LOCK_KEEPALIVES, "connect_timeout": 10}.items() if k not in u.query}
    # Autocommit: a session-level lock needs no transaction, and one left open would make the holder's
    # session "idle in transaction" (which idle_in_transaction_session_timeout ends).
    engine = sa.create_engine(u, poolclass=sa.pool.NullPool, isolation_level="AUTOCOMMIT", connect_args=args)
    if driver == "pymysql":
        sa.event.listen(engine, "connect", _pymysql_keepalives)
    return engine


def _pymysql_keepalives(dbapi_connection, _record) -> None:
    """PyMySQL turns SO_KEEPALIVE on with the system's timings (the first probe after two hours on Linux)."""
    sock = getattr(dbapi_connection, "_sock", None)
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for option, value in (("TCP_KEEPIDLE", "keepalives_idle"), ("TCP_KEEPINTVL", "keepalives_interval"),
                              ("TCP_KEEPCNT", "keepalives_count")):
            if hasattr(socket, option):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), timings.LOCK_KEEPALIVES[value])


def _lock_session(conn, mysql: bool) -> None:
    """No session or statement timeout on the lock connection, whatever the server's or the user's defaults
    (PGOPTIONS, init_command): a waiter waits, and a holder's idle session is not ended under it."""
    import sqlalchemy as sa

    if mysql:
        # MariaDB has max_statement_time, MySQL max_execution_time: each refuses the other's.
        for setting in ("SET SESSION wait_timeout = 31536000", "SET SESSION max_statement_time = 0",
                        "SET SESSION max_execution_time = 0"):
            with contextlib.suppress(sa.exc.ProgrammingError, sa.exc.OperationalError, sa.exc.InternalError):
                conn.execute(sa.text(setting))
        return
    settings = ["statement_timeout", "lock_timeout", "idle_in_transaction_session_timeout"]
    if (conn.dialect.server_version_info or (0,)) >= (14,):
        settings.append("idle_session_timeout")
    for name in settings:
        conn.execute(sa.text(f"SET {name} = 0"))


def _db_acquire(engine, mysql: bool, key: int, shown: str, patient: bool):
    """A connection holding the lock `key`. A session the server ends during the wait (a restart, a killed
    session, a timeout) is opened again and the wait goes on: up to LOCK_LOSSES sessions, and LOCK_RECONNECT
    seconds to reach the server each time (not `patient`, opening a storage: a server that does not answer raises
    at once, a wrong host is one line without a wait); then one HeadsearchError line."""
    import sqlalchemy as sa

    losses, outage, pause = 0, None, 0.5
    while True:
        try:
            conn = engine.connect()
        except sa.exc.DBAPIError as e:
            if not patient:
                raise
            outage = outage or time.monotonic()
            if time.monotonic() - outage > timings.LOCK_RECONNECT:
                raise HeadsearchError(f"{shown}: cannot reach the database (tried for"
                                      f" {timings.LOCK_RECONNECT} s): {_db_error_line(e)}") from None
            time.sleep(pause)
            pause = min(2 * pause, 5)
            continue
        outage, pause = None, 0.5
        try:
            _lock_session(conn, mysql)
            if mysql:
                # GET_LOCK returns 0 when its wait times out: ask again rather than go on without the lock.
                while conn.execute(sa.text("SELECT GET_LOCK(:k, 60)"), {"k": str(key)}).scalar() != 1:
                    pass
            else:
                conn.execute(sa.text("SELECT pg_advisory_lock(:k)"), {"k": key})
            return conn
        except BaseException as e:
            with contextlib.suppress(Exception):
                conn.close()
            if not isinstance(e, sa.exc.DBAPIError):
                raise
            if not (e.connection_invalidated or isinstance(e, sa.exc.OperationalError)):
                raise HeadsearchError(f"{shown}: {_db_error_line(e)}") from None
            losses += 1
            if losses >= timings.LOCK_LOSSES:
                raise HeadsearchError(
                    f"{shown}: the database ended this worker's session {losses} times while it"
                    f" waited for the lock (last: {_db_error_line(e)}): check the server (restarts, killed sessions)") from None
            _log.warning("headsearch: the database ended the session waiting for the %s (%s):"
                         " waiting again on a new one", shown, _db_error_line(e))


@contextlib.contextmanager
def _db_lock(url: str, key: int, mysql: bool, kind: str = "budget lock", patient: bool = True) -> Iterator[LockHold]:
    """PostgreSQL's advisory lock or MySQL's GET_LOCK (`mysql`: `schemes.is_mysql(url)`; the lock named `str(key)`,
    asked again when its wait times out) on a connection of its own, made to last while held: in autocommit
    (never "idle in transaction"), with no session timeouts (`_lock_session`), TCP keepalives (`_lock_engine`).
    A session the server ends anyway released the lock with it: the holder learns it at unlock (`LockHold.lost`,
    a warning), not as a traceback. `kind` names the lock in its messages; `patient`: see `_db_acquire`."""
    import sqlalchemy as sa

    where = f"on {sa.engine.make_url(url).render_as_string(hide_password=True)}"
    hold, shown = LockHold(where, kind), f"{kind} {where}"
    engine = _lock_engine(url)
    try:
        conn = _db_acquire(engine, mysql, key, shown, patient)
        try:
            yield hold
        finally:
            try:
                unlock = "SELECT RELEASE_LOCK(:k)" if mysql else "SELECT pg_advisory_unlock(:k)"
                if not conn.execute(sa.text(unlock), {"k": str(key) if mysql else key}).scalar():
                    hold.lose("its database session no longer held it")
            except sa.exc.DBAPIError as e:
                hold.lose(f"the database ended its session ({_db_error_line(e)}), which released the lock then")
            finally:
                with contextlib.suppress(Exception):
                    conn.close()
    finally:
        engine.dispose()
