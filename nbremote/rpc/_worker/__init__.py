"""Floor 4 of ``nbremote.rpc``, beside ``_driver``: what runs inside a worker kernel.

``install`` is what the driver's bootstrap runs in a kernel: it makes the kernel's agent, registers the
``nbremote`` comm target and a channel per caller, and expires the leases of callers that went silent;
``shellpath`` serves nbremote's own shell messages where they arrive, and ``receivers`` are the executor
threads that take them off the shell socket. Nothing here runs in the driver.
"""

__all__: list[str] = []
