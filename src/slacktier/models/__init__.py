"""models room: real model code wired to the tier.

- `deepseek_v41`: transformers' DeepseekV4 layers + Engram modules (V41Config, V41Model).
- `qwen38`: transformers' Qwen4Exp with its n-gram table read through a provider (Q38Served).
- `engram`: the Engram projection and gate (SGLang 0.5.23's arithmetic).
- `rows`: the RowProvider interface, the stock DRAM table, the step-engine provider.
"""
