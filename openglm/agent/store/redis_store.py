"""Redis store: for several workers on several machines sharing one task queue.

Layout (prefix `openglm:` by default): a hash per task (each field JSON-encoded), a list per task
for its events (seq = position + 1, never trimmed), a sorted set of all tasks and one of the
claimable ones (QUEUED / RUNNING). Every multi-key change is one Lua script, so it is atomic and a
client killed mid-write leaves nothing half-done. Lease times use the Redis server's clock, so
workers on machines with skewed clocks still agree.

A Redis restart or network blip: redis-py reconnects and retries each command with exponential
backoff (about 15 s in all); past that the call raises `StoreUnavailable` (nothing written) and the
worker's loop backs off and tries again, so a blip never fails a task. Lua scripts are re-sent
after a restart empties the script cache (redis-py's Script does that on NOSCRIPT).
"""

from __future__ import annotations

import functools
import json
import time

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from openglm.agent.faults import crashpoint
from openglm.agent.store.base import (
    Event,
    LeaseLost,
    StateConflict,
    Store,
    StoreUnavailable,
    TaskNotFound,
    event_from_json,
    event_json,
)
from openglm.agent.task import Task

# KEYS: task hash, events list, active zset. ARGV: worker fence ('' = none), expected states
# ('|"A"|"B"|' or ''), task id, n events, events..., field/value pairs...
_APPEND = """
if redis.call('EXISTS', KEYS[1]) == 0 then return redis.error_reply('NOTFOUND') end
if ARGV[1] ~= '' then
  local owner = redis.call('HGET', KEYS[1], 'worker')
  if owner ~= ARGV[1] then return redis.error_reply('LEASELOST ' .. tostring(owner)) end
end
if ARGV[2] ~= '' then
  local st = redis.call('HGET', KEYS[1], 'state')
  if not string.find(ARGV[2], '|' .. st .. '|', 1, true) then return redis.error_reply('CONFLICT ' .. st) end
end
local n = tonumber(ARGV[4])
for i = 1, n do redis.call('RPUSH', KEYS[2], ARGV[4 + i]) end
for i = 5 + n, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
local st = redis.call('HGET', KEYS[1], 'state')
if st == '"QUEUED"' or st == '"RUNNING"' then
  redis.call('ZADD', KEYS[3], redis.call('HGET', KEYS[1], 'created_at'), ARGV[3])
else
  redis.call('ZREM', KEYS[3], ARGV[3])
end
return redis.call('LLEN', KEYS[2])
"""

# KEYS: active zset. ARGV: key prefix, worker (JSON), ttl.
_CLAIM = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
for _, id in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  local key = ARGV[1] .. 'task:' .. id
  local st = redis.call('HGET', key, 'state')
  local lease = tonumber(redis.call('HGET', key, 'lease_until') or '0')
  if st == '"QUEUED"' or (st == '"RUNNING"' and lease < now) then
    redis.call('HSET', key, 'state', '"RUNNING"', 'worker', ARGV[2],
               'lease_until', string.format('%.6f', now + tonumber(ARGV[3])), 'updated_at', string.format('%.6f', now))
    return id
  end
end
return false
"""

# KEYS: task hash. ARGV: worker (JSON), ttl.
_HEARTBEAT = """
if redis.call('EXISTS', KEYS[1]) == 0 then return redis.error_reply('NOTFOUND') end
local owner = redis.call('HGET', KEYS[1], 'worker')
if owner ~= ARGV[1] then return redis.error_reply('LEASELOST ' .. tostring(owner)) end
local t = redis.call('TIME')
redis.call('HSET', KEYS[1], 'lease_until', \
string.format('%.6f', tonumber(t[1]) + tonumber(t[2]) / 1e6 + tonumber(ARGV[2])))
return 1
"""


RETRIES = 8  # 0.1 s doubling, capped at 4 s: ~15 s of reconnect attempts per call


def _guarded(method):
    """Connection failures that outlast redis-py's retries become StoreUnavailable."""

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise StoreUnavailable("redis unreachable", str(exc)) from exc
        except redis.ResponseError as exc:
            if "OOM" in str(exc) or "MISCONF" in str(exc) or "LOADING" in str(exc):
                raise StoreUnavailable("redis refuses writes", str(exc)) from exc
            raise

    return call


class RedisStore(Store):
    def __init__(self, url: str = "redis://127.0.0.1:6379/0", prefix: str = "openglm:", retries: int = RETRIES):
        self.r = redis.Redis.from_url(url, decode_responses=True, socket_connect_timeout=5, socket_timeout=30,
                                      retry=Retry(ExponentialBackoff(cap=4.0, base=0.1), retries),
                                      retry_on_error=[redis.ConnectionError, redis.TimeoutError],
                                      health_check_interval=30)
        self.p = prefix
        self._append = self.r.register_script(_APPEND)
        self._claim = self.r.register_script(_CLAIM)
        self._heartbeat = self.r.register_script(_HEARTBEAT)

    def _tkey(self, task_id):
        return f"{self.p}task:{task_id}"

    def _ekey(self, task_id):
        return f"{self.p}events:{task_id}"

    def close(self):
        self.r.close()

    @_guarded
    def create_task(self, task: Task, events=()) -> Task:
        key = self._tkey(task.id)
        fields = {k: json.dumps(v, ensure_ascii=False) for k, v in task.to_dict().items()}
        pipe = self.r.pipeline(transaction=True)  # MULTI/EXEC: the task and its first events, or nothing
        pipe.hset(key, mapping=fields)
        if events:
            pipe.rpush(self._ekey(task.id), *[event_json(k, st, d) for k, st, d in events])
        pipe.zadd(f"{self.p}tasks", {task.id: task.created_at})
        pipe.zadd(f"{self.p}active", {task.id: task.created_at})
        pipe.execute()
        return task

    @_guarded
    def get_task(self, task_id: str) -> Task:
        raw = self.r.hgetall(self._tkey(task_id))
        if not raw:
            raise TaskNotFound(task_id)
        return Task.from_dict({k: json.loads(v) for k, v in raw.items()})

    @_guarded
    def list_tasks(self, limit: int = 100, offset: int = 0) -> list[Task]:
        ids = self.r.zrevrange(f"{self.p}tasks", offset, offset + limit - 1)
        pipe = self.r.pipeline(transaction=False)
        for i in ids:
            pipe.hgetall(self._tkey(i))
        return [Task.from_dict({k: json.loads(v) for k, v in raw.items()}) for raw in pipe.execute() if raw]

    def _run_append(self, task_id, events, fields, worker, expect_state) -> int:
        for k in fields or {}:
            if k not in Task.__dataclass_fields__:
                raise KeyError(f"unknown task field {k!r}")
        fields = dict(fields or {}, updated_at=time.time())
        argv = [json.dumps(worker) if worker is not None else "",
                "|" + "|".join(json.dumps(s) for s in expect_state) + "|" if expect_state else "",
                task_id, len(events), *events]
        for k, v in fields.items():
            argv += [k, json.dumps(v, ensure_ascii=False)]
        crashpoint("store_before_commit")  # the script is atomic: a kill lands before or after it
        try:
            return self._append(keys=[self._tkey(task_id), self._ekey(task_id), f"{self.p}active"], args=argv)
        except redis.ResponseError as e:
            msg = str(e)
            if msg.startswith("NOTFOUND"):
                raise TaskNotFound(task_id) from None
            if msg.startswith("LEASELOST"):
                raise LeaseLost(f"task {task_id} is owned by {msg.split(' ', 1)[1]}, not {worker}") from None
            if msg.startswith("CONFLICT"):
                raise StateConflict(f"task {task_id} is {msg.split(' ', 1)[1]}, expected one of "
                                    f"{sorted(expect_state)}") from None
            raise

    @_guarded
    def update_task(self, task_id, fields, *, worker=None, expect_state=None) -> Task:
        self._run_append(task_id, [], fields, worker, expect_state)
        return self.get_task(task_id)

    @_guarded
    def append(self, task_id, events, fields=None, *, worker=None, expect_state=None) -> list[int]:
        n = self._run_append(task_id, [event_json(k, s, d) for k, s, d in events], fields, worker, expect_state)
        return list(range(n - len(events) + 1, n + 1))

    @_guarded
    def events(self, task_id, after=0, limit=1000) -> list[Event]:
        rows = self.r.lrange(self._ekey(task_id), after, after + limit - 1)
        return [event_from_json(after + i + 1, row) for i, row in enumerate(rows)]

    @_guarded
    def event_count(self, task_id) -> int:
        return self.r.llen(self._ekey(task_id))

    @_guarded
    def claim(self, worker, ttl) -> Task | None:
        task_id = self._claim(keys=[f"{self.p}active"], args=[self.p, json.dumps(worker), ttl])
        return self.get_task(task_id) if task_id else None

    @_guarded
    def heartbeat(self, task_id, worker, ttl) -> Task:
        try:
            self._heartbeat(keys=[self._tkey(task_id)], args=[json.dumps(worker), ttl])
        except redis.ResponseError as e:
            if str(e).startswith("NOTFOUND"):
                raise TaskNotFound(task_id) from None
            raise LeaseLost(f"task {task_id}: {e}") from None
        return self.get_task(task_id)
