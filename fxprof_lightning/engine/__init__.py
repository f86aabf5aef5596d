"""The engine: every option declared once (``settings``), when cycles open and close (``core``: ``Engine``;
``profiler``: ``Profiler``, for any loop), a loop's schedule position (``stage``), the ranks (``ranks``), one cycle in
progress (``cycle``) and its statistics (``statistics``), the phases of the whole step (``step_phases`` with
Lightning, ``loop_phases`` in a plain loop) and what starts cycles out of the schedule (``follow``: requests,
step-time jumps, the budget) and the idle steps between cycles (``idle``). Nothing is imported here: ``fxprof`` (the command) reads ``follow`` without importing
torch."""
