"""The timings of the budget locks, read from this module by `locks` and `server_locks` at each use, never copied:
setting `headsearch.search.storage.timings.LOCK_SILENCE` (a test, a worker script) reaches every lock."""
LOCK_SILENCE = 30  # seconds: a budget lock not renewed for this long belongs to a dead worker and is broken
LOCK_RENEW = 5  # seconds between a live holder's renewals
LOCK_RECONNECT = 60  # seconds a worker keeps trying to reach the database of its budget lock again
LOCK_LOSSES = 5  # database sessions one wait for the budget lock may lose (then the worker stops with one line)
REDIS_TIMEOUT = 30  # seconds: a Redis command unanswered this long fails (a frozen server) instead of hanging
REDIS_CONNECT_TIMEOUT = 10  # seconds to open a connection to Redis
# TCP keepalives of a database lock connection (libpq's parameters; the same timings for PyMySQL's socket): a
# peer gone silent is noticed within about a minute, and an idle lock connection is not dropped unseen.
LOCK_KEEPALIVES = {"keepalives": 1, "keepalives_idle": 30, "keepalives_interval": 10, "keepalives_count": 3}
