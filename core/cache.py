"""The Redis cache with one connection pool per process, not one per request.

Django keeps a cache backend per context (`caches` is an asgiref Local that is not
thread-critical), and under ASGI every request runs in a context of its own. So each request
made a new RedisCache, its client a new connection pool, and the API's rate limit, the first to
count, a new TCP connection to Redis (and dropped it). Profiled under daphne (py-spy, `GET
/api/me/` in a loop), connecting to Redis was 8% of the web worker's samples.

Here the client (redis-py's pool, which is thread-safe) is made once per process for each
location and set of options, and every backend instance shares it. The counts, keys and
timeouts are Django's own: only where the connections come from changes.

It also counts in a window in one round trip (count_in_window, for core.throttling.count): Django's
incr() asks Redis whether the key exists, then increments it, two round trips for every API call.
"""

import threading

from django.core.cache.backends.redis import RedisCache

_clients = {}
_made = threading.Lock()


class SharedRedisCache(RedisCache):
    @property
    def _cache(self):
        key = (tuple(self._servers), repr(sorted(self._options.items())))
        client = _clients.get(key)
        if client is None:
            with _made:
                client = _clients.setdefault(key, self._class(self._servers, **self._options))
        return client

    def count_in_window(self, key, seconds):
        """One more against key, in a window of `seconds` the first count opens: (the count,
        whether this count opened the window). One round trip, one transaction: SET NX EX opens
        the window with its expiry (so no count is ever left without one), INCR counts. The
        count is stored as Django stores an integer, so get() reads it."""
        full = self.make_and_validate_key(key)
        with self._cache.get_client(full, write=True).pipeline(transaction=True) as pipe:
            pipe.set(full, 0, ex=max(1, int(seconds)), nx=True)
            pipe.incr(full)
            opened, counted = pipe.execute()
        return counted, bool(opened)
