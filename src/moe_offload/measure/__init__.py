"""Measure: benchmarks that run the model and say what it cost, in bytes and seconds.

bench (arms at one budget, timed step by step: run_bench), arms (what the user names: arms, concurrency,
prompts), timing (the instrument every arm is timed by: the greedy run, timing columns, link bytes, peak
RSS), runtime_rows (the rows of moe_offload's own arms), readback (their settings, read back from the
loaded model), accelerate_arm (the peer), profile (routing traces of a real run), plots. May import: every
stage below, and the Python API (api).
"""
