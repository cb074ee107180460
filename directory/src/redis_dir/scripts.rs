//! The Lua scripts of the Redis directory: every check-then-write runs atomically on the
//! server. Each script's comment gives its keys, arguments and answer; `answers` reads
//! the answers.

use redis::Script;

/// Lua: the server's clock in ms, with effects replication on where Redis < 7 needs it for
/// a script that writes after reading the clock.
pub(super) const NOW_LUA: &str = r"
if redis.replicate_commands then redis.replicate_commands() end
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
";

/// Creates the node record, refreshes it, or refuses another session. KEYS[1] node record,
/// KEYS[2] the live-node index (a sorted set: address → expiry in server ms); ARGV:
/// session, stale ms, fresh tag, server run_id ('' = unknown), the tag the caller last heard
/// of ('' = none), the address, max nodes. Returns {-1} (conflict), {-2, live nodes} (a new
/// record would pass max nodes) or {lost, tag}: lost is 1 when the record is new, was
/// reloaded by another server process (then it gets the fresh tag), or holds a tag the
/// caller has not heard of (an earlier answer was lost on the way).
pub(super) const HEARTBEAT_BODY: &str = r"
local rec = redis.call('HMGET', KEYS[1], 'session', 'run', 'tag')
local now = now_ms()
if not rec[1] then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
  local n = redis.call('ZCARD', KEYS[2])
  if not redis.call('ZSCORE', KEYS[2], ARGV[6]) and n >= tonumber(ARGV[7]) then return {-2, n} end
  redis.call('HSET', KEYS[1], 'session', ARGV[1], 'tag', ARGV[3], 'owned', 0, 'run', ARGV[4])
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  redis.call('ZADD', KEYS[2], now + tonumber(ARGV[2]), ARGV[6])
  return {1, ARGV[3]}
end
if rec[1] ~= ARGV[1] then return {-1} end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[2]), ARGV[6])
if (ARGV[4] ~= '' and rec[2] ~= ARGV[4]) or not rec[3] then
  redis.call('HSET', KEYS[1], 'tag', ARGV[3], 'owned', 0, 'run', ARGV[4])
  return {1, ARGV[3]}
end
if rec[3] ~= ARGV[5] then return {1, rec[3]} end
return {0, rec[3]}
";

/// Records ownership. KEYS[1] node record, KEYS[2..] block keys; ARGV: session, addr, ttl
/// secs, stale ms, min reclaimable (0 = off), node key prefix, live-node index key, max
/// entries per node. Returns {-1} (unknown session), {-2, owned} (the node would own more
/// than max entries: nothing of this script's keys was kept) or {0, newly owned, a string
/// with '1' at each key this script made the node an owner of and '0' elsewhere, 1-based
/// positions of reclaimable keys...}.
pub(super) const INSERT_BODY: &str = r"
local rec = redis.call('HMGET', KEYS[1], 'session', 'tag', 'owned')
if rec[1] ~= ARGV[1] or not rec[2] then return {-1} end
local tag, addr, ttl, minr = rec[2], ARGV[2], ARGV[3], tonumber(ARGV[5])
local owned, max = tonumber(rec[3] or '0'), tonumber(ARGV[8])
local tags = {[addr] = tag}
local function live(a)
  local t = tags[a]
  if t == nil then
    t = redis.call('HGET', ARGV[6] .. a, 'tag')
    tags[a] = t
  end
  return t
end
local out = {0, 0, ''}
local added = {}
local mark = {}
for i = 2, #KEYS do
  local k = KEYS[i]
  if redis.call('HGET', k, addr) ~= tag then
    if owned + #added >= max then
      for _, j in ipairs(added) do redis.call('HDEL', KEYS[j], addr) end
      return {-2, owned}
    end
    redis.call('HSET', k, addr, tag)
    added[#added + 1] = i
    mark[i - 1] = '1'
    if minr > 0 and redis.call('HLEN', k) >= minr then
      local f = redis.call('HGETALL', k)
      local n = 0
      for j = 1, #f, 2 do
        if live(f[j]) == f[j + 1] then n = n + 1 else redis.call('HDEL', k, f[j]) end
      end
      if n >= minr then out[#out + 1] = i - 1 end
    end
  else
    mark[i - 1] = '0'
  end
  redis.call('EXPIRE', k, ttl)
end
if #added > 0 then redis.call('HINCRBY', KEYS[1], 'owned', #added) end
redis.call('PEXPIRE', KEYS[1], ARGV[4])
redis.call('ZADD', ARGV[7], now_ms() + tonumber(ARGV[4]), addr)
out[2] = #added
out[3] = table.concat(mark)
return out
";

/// Drops ownership. KEYS[1] node record, KEYS[2..] block keys; ARGV: session, addr. The
/// address's field is deleted when it holds the caller's tag (counted) or a dead earlier tag
/// of the same address (not counted; never visible again). Returns the count, or -1.
pub(super) const REMOVE_LUA: &str = r"
local rec = redis.call('HMGET', KEYS[1], 'session', 'tag')
if rec[1] ~= ARGV[1] or not rec[2] then return -1 end
local removed = 0
for i = 2, #KEYS do
  local v = redis.call('HGET', KEYS[i], ARGV[2])
  if v then
    redis.call('HDEL', KEYS[i], ARGV[2])
    if v == rec[2] then removed = removed + 1 end
  end
end
if removed > 0 then redis.call('HINCRBY', KEYS[1], 'owned', -removed) end
return removed
";

/// The live owners' runs over consecutive keys. KEYS: block keys in order; ARGV[1] node key
/// prefix. Returns {stop, {addr, start, len, start, len, ...}, ...}: `stop` is the 0-based
/// position of the first key no live owner holds (#KEYS when there is none; the scan ends
/// there), and each owner's runs (0-based start, length) before it, in order.
pub(super) const QUERY_LUA: &str = r"
local tags = {}
local function live(a)
  local t = tags[a]
  if t == nil then
    t = redis.call('HGET', ARGV[1] .. a, 'tag')
    tags[a] = t
  end
  return t
end
local runs, order, last = {}, {}, {}
local stop = #KEYS
for i = 1, #KEYS do
  local f = redis.call('HGETALL', KEYS[i])
  local any = false
  for j = 1, #f, 2 do
    local a = f[j]
    if live(a) == f[j + 1] then
      any = true
      local r = runs[a]
      if r == nil then
        r = {a}
        runs[a] = r
        order[#order + 1] = a
      end
      if last[a] == i - 1 then
        r[#r] = r[#r] + 1
      else
        r[#r + 1] = i - 1
        r[#r + 1] = 1
      end
      last[a] = i
    end
  end
  if not any then
    stop = i - 1
    break
  end
end
local out = {stop}
for _, a in ipairs(order) do out[#out + 1] = runs[a] end
return out
";

/// Forgets the session's entries by drawing a new tag. KEYS[1] node record; ARGV: session,
/// fresh tag. Returns the entries owned under the old tag, or -1.
pub(super) const RESYNC_LUA: &str = r"
local rec = redis.call('HMGET', KEYS[1], 'session', 'owned')
if rec[1] ~= ARGV[1] then return -1 end
redis.call('HSET', KEYS[1], 'tag', ARGV[2], 'owned', 0)
return tonumber(rec[2] or '0')
";

/// Forgets the node. KEYS[1] node record, KEYS[2] the live-node index; ARGV: session,
/// address. Returns the entries it owned, or -1.
pub(super) const UNREGISTER_LUA: &str = r"
local rec = redis.call('HMGET', KEYS[1], 'session', 'owned')
if rec[1] ~= ARGV[1] then return -1 end
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[2])
return tonumber(rec[2] or '0')
";

/// The scripts, hashed once.
pub(super) struct Scripts {
    pub heartbeat: Script,
    pub insert: Script,
    pub remove: Script,
    pub query: Script,
    pub resync: Script,
    pub unregister: Script,
}

impl Scripts {
    pub fn new() -> Self {
        Self {
            heartbeat: Script::new(&format!("{NOW_LUA}{HEARTBEAT_BODY}")),
            insert: Script::new(&format!("{NOW_LUA}{INSERT_BODY}")),
            remove: Script::new(REMOVE_LUA),
            query: Script::new(QUERY_LUA),
            resync: Script::new(RESYNC_LUA),
            unregister: Script::new(UNREGISTER_LUA),
        }
    }
}
