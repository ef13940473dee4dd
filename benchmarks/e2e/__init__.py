"""The paper's Table 2, Figure 3 and Figure 5 on this machine: one module per stage.

config (what runs) -> jobs (placements and the shuffled job list) -> run (the rig
replays each job; typed records, results.json) -> analysis (Table 2 rows, the
figures' points, the exposure model's fit) -> markdown / plots. The serving
pieces (rig, placements, records, the placement table) are slacktier.serve's.
Entry: benchmarks/bench_e2e_table2.py.
"""
