"""Saving an optimized catalog and loading it in a fresh process: ``cf.save(prog, path)`` / ``cf.load(path)``.

A restarted server would otherwise export the catalog and run ``optimize`` again before its first
chunk (Token2Wav at released sizes on an H200: export 80 s + optimize 26 s, session 9 in docs/benchmarks.md). Profiling ``optimize`` (Token2Wav at
reduced sizes, CPU) puts its time in graph work, not in kernels: ``ep.module()`` (unlifting, about a
third), the passes' analyses, ``split_module``, and generating and compiling each module's Python code
again after each pass; evaluating the hoisted cones is the only compute and digesting the weights
they read the only full read. So the artifact stores the *result* of the pipeline, not its input:

- every rewritten program of the catalog as it left the passes (lane 0, before any replay runner is
  installed): each module's graph (nodes, arguments, the ``cadence_*`` annotations the runtime
  reads), the module tree and which tensor each attribute is, as JSON;
- every tensor those programs reference once, however many programs and modules share it
  (weights, buffers, the hoisted and folded constants), each with its SHA-256; the folded weights'
  digests from ``optimize`` are stored too, so the per-call guard and ``verify_weights`` work
  without digesting them again;
- the workspaces' bytes (all-zero ones as a shape only), the contract, the plan, the region sites,
  each class's admission, and what the bytes depend on: torch and CUDA versions, the device (and the
  GPU model), the kernel-selection settings.

Region buffers are not stored: a loaded program's first call copies its state input in, as a fresh
program's does. :func:`load` rebuilds each module from its stored graph (code generated once per
module), allocates the region buffers and workspaces per lane, and installs the replay runners. CUDA
graphs bind addresses in one process: they are captured again (``prog.warmup``).

An artifact is data, trusted like a checkpoint: its weights and graphs are the model, and a file
edited on purpose computes what its editor chose (the SHA-256 digests it carries sit beside what they
cover: they catch accidents, not edits). What :func:`load` guarantees is that it runs no code from
the file and allocates only what the file's own tensors bound:

- nothing the file holds reaches generated source or an import. torch.fx pastes node names,
  placeholder targets, attribute paths, method and keyword names and the pytree argument names into
  the Python code it generates, so these must be identifiers (and attribute and submodule targets
  must be held by the stored module tree); a call target is an operator of ``_OP_NAMESPACES`` that
  this torch's dispatcher has, or a function of ``_CALLABLES``, looked up in those tables (of
  :mod:`~cadence_fx.artifact.graph_codec`); pytree specs are containers of identifier keys before
  torch's loader (which imports the modules an enum names) sees them; annotations have the kinds of
  ``_META_KINDS``;
- values nest at most ``values.MAX_DEPTH`` levels; the workspaces and region buffers a lane
  allocates, and each stored tensor, take at most the stored tensors' bytes or
  ``manifest.ALLOCATION_FLOOR``, whichever is larger;
- anything else malformed is :class:`ArtifactError` naming the file. To know the file is the one
  that was written, pin it: ``save`` returns its SHA-256, ``load(path, sha256=...)`` refuses another.

What a graph computes once called is not bounded: like a checkpoint's model, it may allocate what its
operators ask for.

The format is one file written by ``torch.save`` and read with ``torch.load(weights_only=True)``.
``torch.export.save`` is not used for the rewritten programs: its serializer takes functional exported
programs, and these are not (in-place writes into contract-owned buffers, partitions as submodules,
annotations); rebuilding them from the stock programs on load would cost the whole pipeline, which is
what the artifact exists to skip. Loading needs neither the model's code nor the upstream packages.

The package, one module a job: :mod:`~cadence_fx.artifact.saving` (``save``: the module walker),
:mod:`~cadence_fx.artifact.loading` (``load``), :mod:`~cadence_fx.artifact.source` (the program source that
rebuilds a lane's programs from the manifest), :mod:`~cadence_fx.artifact.graph_codec` (graphs and their
checks), :mod:`~cadence_fx.artifact.values` (values, contract, plan, sites, findings),
:mod:`~cadence_fx.artifact.manifest` (the file, the manifest's bounds, digests),
:mod:`~cadence_fx.artifact.environment` (build, device, kernel settings, contract) and
:mod:`~cadence_fx.artifact.exceptions`.
"""

import torch  # noqa: F401 - ``cadence_fx.artifact.torch``, as before the split (tests patch torch.save through it)

from cadence_fx.artifact.exceptions import ArtifactError, ArtifactMismatch
from cadence_fx.artifact.loading import iter_artifact_tensors, load
from cadence_fx.artifact.saving import save

__all__ = ["ArtifactError", "ArtifactMismatch", "iter_artifact_tensors", "load", "save"]
