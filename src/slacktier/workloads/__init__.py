"""Real traffic for the tables: agent and chat sessions, replay traces, access characterization.

One role per module:

- `sessions`: Turn / Session (text) and TokenSession (DeepSeek-V4 tokens, reply bounds); the chat format.
- `qwen_sessions`: the same Sessions in Qwen's chat format and Qwen token ids (PLE traffic).
- `sharegpt`: record-by-record parsing of the truncated ShareGPT JSON; chat Sessions.
- `trajectories`: published agent trajectories (SWE-agent .traj, mini-swe-agent, OpenHands) as Sessions.
- `agent`: synthetic SWE-agent-style sessions from real commands on real source trees; the .npz session cache.
- `corpus`: both workloads as TokenSessions (DeepSeek or Qwen ids), split by source (`load_workload`).
- `split`: fit/holdout split by source.
- `hashing`: the hasher interface (Engram V4.1, PLE) as [T, L, C] row ids plus a HashSpec; which ids each
  table hashes.
- `replay`: interleaved replay as Step records (`replay_steps`), flattened to a LookupTrace.
- `policies`: compiled cache policies (LRU, CLOCK, S3-FIFO-style, static, static head + LRU, Belady).
- `admission`: admission rules in front of CLOCK (n-gram order, prefill probation, cold insert, TinyLFU sketch),
  compiled, for weighing against the served CLOCK and Belady; not served.
- `characterize`: hit rates per policy/capacity/order, batch reuse, miss-page curves P_l(c) for the planner.

The slow plain-Python simulators the kernels are tested against live beside their benchmark,
benchmarks/micro/policy_reference.py and benchmarks/micro/admission_reference.py, outside the package.
"""
