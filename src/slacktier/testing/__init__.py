"""Local stand-ins for a deployment, for trying the tiers and for the tests and benchmarks: not the serving path.

    redis_cluster.py   LocalRedisCluster: real redis-server nodes on loopback, ACL users (reader, loader),
                       optional TLS with throwaway openssl certificates; kill / restart / pause / migrate a slot

Why here and not in tests/ or benchmarks/: the tests (fixtures) and the benchmarks (the tier's own, and the
step timeline's remote placements in benchmarks/paper/timeline_sweep.py) start one, and a user trying the Redis
tier in cluster mode wants the same thing (docs/remote.md's least-privilege ACL rules are this module's
READER_RULES / LOADER_RULES). No room of the package imports this one (tests/test_layers.py).
"""
