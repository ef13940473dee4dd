"""Local stand-ins for a deployment, for trying the tiers and for the tests and benchmarks: not the serving path.

    redis_cluster.py   LocalRedisCluster: real redis-server nodes on loopback, ACL users (reader, loader),
                       optional TLS with throwaway openssl certificates; kill / restart / pause / migrate a slot
    store.py           RedisServer (one real redis-server on a free port), synthetic staged regions,
                       supports_o_direct
    engine.py          ArraySource (a complete in-memory PageSource that can fail a page as a tier fails),
                       real text and its Engram row ids (the DeepSeek-V4 tokenizer over vendored source files)
    tables.py          FailingSource: a row source that stops partway, the way a restage dies

Why here and not in tests/ or benchmarks/: the tests (fixtures) and the benchmarks (the tier's own, and the
step timeline's remote placements in benchmarks/paper/timeline_sweep.py) start one, and a user trying the Redis
tier in cluster mode wants the same thing (docs/remote.md's least-privilege ACL rules are this module's
READER_RULES / LOADER_RULES). No room of the package imports this one (tests/test_layers.py).
"""
