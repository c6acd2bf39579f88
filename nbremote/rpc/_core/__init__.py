"""Floor 3 of ``nbremote.rpc``, beside ``_kernels``: what every member of the world runs, driver and workers alike."""

__all__: list[str] = []
