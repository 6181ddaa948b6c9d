"""The budget lock of each storage (search/storage.py `budget_lock`): mutual exclusion, a live holder keeps
its lock past the silence limit, and a dead holder's lock is broken after it. The whole searches with
`--workers 2` on each storage are in test_search.py."""
import threading
import time
import uuid
from pathlib import Path

import pytest

from headsearch.search import storage
from headsearch.search.storage import budget_lock
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


@pytest.mark.parametrize("kind", ["journal", "redis"])
def test_a_live_holder_keeps_the_lock_and_a_dead_ones_lock_is_broken(kind, request, tmp_path, monkeypatch):
    """With a 1.5 s silence limit renewed every 0.2 s: a holder that keeps the lock for 2.5 s keeps it to the
    end (the waiter gets it only after release), and a lock nobody renews (its worker was killed) is taken
    about 1.5 s later, not never."""
    monkeypatch.setattr(storage, "LOCK_SILENCE", 1.5)
    monkeypatch.setattr(storage, "LOCK_RENEW", 0.2)
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
