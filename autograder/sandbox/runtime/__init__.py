"""The only code of the grader inside the sandbox: the worker that runs the submission's cells and
answers calls, the limits it puts on itself, and the wire format. Imports nothing outside this folder."""
