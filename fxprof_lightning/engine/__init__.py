"""The engine: when cycles open and close (``profiler``: ``Engine``, and ``Profiler`` for any loop), one cycle in
progress (``cycle``), the phases of the whole step (``step_phases`` with Lightning, ``loop_phases`` in a plain loop)
and what starts cycles out of the schedule (``follow``: requests, step-time jumps, the budget). Nothing is imported
here: ``fxprof`` (the command) reads ``follow`` without importing torch."""
