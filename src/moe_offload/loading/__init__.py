"""Loading: a checkpoint streamed straight into its plan, then handed to the runtime.

May import: errors, formats, model, planning, routing, storage, run.
"""
