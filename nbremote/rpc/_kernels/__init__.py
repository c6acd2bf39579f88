"""Floor 3 of ``nbremote.rpc``, beside ``_core``: how worker kernels are started, attached and hosted.

``local`` (``LocalKernel``: the embedded default, forked by the ``zygote``, or an installed kernelspec),
``provisioned`` (kernelspecs whose provisioner runs them elsewhere), ``attached`` (``AttachedKernel``,
directly or through an SSH ``tunnel``) and ``hosted`` (``ServerKernel``: a Jupyter server's or gateway's
kernel, over REST and its websocket). Each gives the driver a ``handle.StartedKernel``; ``paths`` keeps
their connection files and logs private. It builds on ``_transport`` and ``_wire``, and knows nothing of
agents, calls or RRefs (``_core``), which never import it either. Import the modules themselves.
"""

__all__: list[str] = []
