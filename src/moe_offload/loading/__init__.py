"""Loading: a checkpoint streamed straight into its plan, then handed to the runtime.

loader (load: the orchestration, from the checked plan to the attached runtime), allocate (each tensor's
memory in its tier), stream (the checkpoint read once into that memory).
May import: errors, formats, model, planning, routing, storage, run.
"""
