"""Serving conversations: the streaming front end (:mod:`cadence_fx.serve.protocol`, the wire format;
:mod:`cadence_fx.serve.frontend`, the Ray Serve WebSocket endpoint; :mod:`cadence_fx.serve.local_backend`,
an in-process backend over one program's sessions) and the workers behind it.

Submodules are imported on their own (``from cadence_fx.serve.protocol import ...``): the protocol needs
only torch, the front end needs Ray Serve and FastAPI.
"""
