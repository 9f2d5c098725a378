"""Proposing a native-clock contract from a recorded stream (``cf.propose_contract``).

    calls = [...]                                   # >= 3 calls of a real stream, state fed back
    proposal = cf.propose_contract(step, calls)     # clock "frame", the whole step wrapped
    print(proposal)                                 # pasteable code, then the evidence as comments
    eps = cf.export_catalog(step, proposal.contract, calls[0])

One job per module: ``observe`` (the eager replay: outputs, concatenations, which input is fed
back), ``graph_facts`` (the exported graph's cats and writes of a state), ``retention`` (axis,
growth, order, retention of a fed-back input, checked by values), ``module_buffers`` (state kept in
module buffers written in place), ``render`` (code and comments), ``propose`` (the entry point).
"""

from cadence_fx.proposal.propose import Proposal, propose_contract

__all__ = ["Proposal", "propose_contract"]
