"""Routing: which experts are read when, without running the model.

expert_cache (the interface every expert-cache policy implements), cache_policy (LRU, LFU, heat, Belady:
one object per policy, driven alike by the runtime and by replay), replay (what a trace's decode tokens
read under a placement and a cache). May import: errors, formats, model, planning.
"""
