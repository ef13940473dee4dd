"""The remote memory tier: one copy of a table in Redis (a standalone server or a Redis Cluster / Valkey),
shared by every serving instance that points at it. Files by role:

    keys.py      the key layout (hash-tagged page groups) and load generations, one for both modes
    client.py    the control-plane connection: standalone or cluster, credentials, TLS, topology
    identity.py  which table a prefix holds, complete, every page group in its generation
    loader.py    staged table -> Redis, verified and resumable (`slacktier load`)
    source.py    RedisSource, the page source (tier "redis")
    _wire.py     page reads on the tier's own sockets, and why not a library
    _resp.py     the compiled RESP packing and reply scan

Control file: `source = "redis"`, `[table.redis] mode = "standalone" | "cluster"` (config.RedisOptions).
"""
