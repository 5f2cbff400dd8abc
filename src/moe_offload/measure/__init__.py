"""Measure: benchmarks that run the model and say what it cost, in bytes and seconds.

bench (arms at one budget, timed step by step), accelerate_arm (the peer), profile (routing traces of
a real run), plots. May import: every stage below, and the Python API (api).
"""
