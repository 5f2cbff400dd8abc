"""The command line: the parser and main's error mapping (main), what each command does (commands), the
terminal tables (report). May import: everything.
"""
