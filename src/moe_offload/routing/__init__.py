"""Routing: which experts are read when, without running the model.

cache_policy (one object per expert-cache policy, driven alike by the runtime and by replay) and replay
(what a trace's decode tokens read under a placement and a cache). May import: errors, formats, model,
planning.
"""
