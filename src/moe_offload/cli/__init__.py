"""The command line: the parser and main's error mapping (main), what each command does (run_commands: the
commands that run the model; plan_commands: those that plan without running it), what they share about
their options (options: budget, model path, saved plans, output files), the terminal tables (report).
May import: everything.
"""
