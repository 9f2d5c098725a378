"""What the passes and the runtime read off ATen-level FX graphs, one question per module.

- :mod:`~cadence_fx.analysis.ops`: what kind of op a node is (a view, a write, a draw, a move, a guard),
  from its ATen schema and tags;
- :mod:`~cadence_fx.analysis.aliases`: which tensor a value lives in (through views and in-place returns);
- :mod:`~cadence_fx.analysis.graph_io`: a graph's outputs, its module's attributes, the few nodes the
  passes build and read (flat views, cat dims, recorded shapes);
- :mod:`~cadence_fx.analysis.boxes`: the slice box each use of a tensor can touch, and whether boxes cover;
- :mod:`~cadence_fx.analysis.traffic`: the state bytes one call writes (``ProgramFacts.state_bytes``);
- :mod:`~cadence_fx.analysis.writes`: the module tensors a program writes in place, and which carry over.

Nothing here edits a graph but :func:`~cadence_fx.analysis.graph_io.set_flat_output`,
:func:`~cadence_fx.analysis.graph_io.flat_view` and :func:`~cadence_fx.analysis.graph_io.register_tensor`.
"""
