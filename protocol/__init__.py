"""The pure Decoupled DiLoCo core (docs/design.md, sections 1 and 3).

Everything here is a function of its arguments: no sockets, no asyncio, no clock reads. Time is always passed
in as ``now``. The in-process runner, the simulator and the real node all drive these same functions.
"""
