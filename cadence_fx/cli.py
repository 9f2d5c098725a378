"""``cadence-fx`` command line: ``cadence-fx plan TARGET [--traffic]``.

TARGET is ``demo`` (the demo decoder), ``token2wav`` (the released Token2Wav estimator region,
needs the upstream package; see cadence_fx.adapters.token2wav), or ``package.module:function``
naming a function that returns ``(exported_program_or_list, contract)``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any, Sequence

_HELP = """cadence-fx plan TARGET: print a streaming step's stored and attended extents, bytes,
over-reservation and its catalog of exact signature classes.

TARGET is one of
  demo               the demo decoder
  token2wav          the released Token2Wav flow step (needs minicpmo 0.1.2: pip install --no-deps
                     minicpmo==0.1.2, or CADENCE_FX_UPSTREAM=<folder holding minicpmo-0.1.2/>)
  package.module:fn  a function returning (exported program or list of them, contract)"""


def _load(target: str) -> tuple[Any, Any]:
    if target == "demo":
        from cadence_fx.testing.demo_model import DemoConfig, StreamingDecoder, demo_contract, export_catalog  # deferred: torch

        cfg = DemoConfig()
        contract = demo_contract(cfg)
        return export_catalog(StreamingDecoder(cfg).eval(), contract), contract
    if target == "token2wav":
        from cadence_fx.adapters import token2wav  # deferred: only this target needs the adapter

        return token2wav.plan_target()
    if ":" not in target:
        raise _Usage(f"TARGET must be 'demo', 'token2wav' or 'module:function', got {target!r}")
    mod, fn = target.split(":", 1)
    try:
        factory = getattr(importlib.import_module(mod), fn)
    except ImportError as e:
        raise _Usage(f"cannot import {mod!r} ({e})") from None
    except AttributeError:
        raise _Usage(f"module {mod!r} has no function {fn!r}") from None
    got = factory()
    if not (isinstance(got, tuple) and len(got) == 2):
        raise _Usage(f"{target} must return (exported program or list of them, contract), got {type(got).__name__}")
    return got


class _Usage(Exception):
    """A target the command line cannot use: printed as a usage error, not a traceback."""


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="cadence-fx", description=_HELP,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("plan", help="print extents, bytes, over-reservation and the signature catalog")
    p.add_argument("target")
    p.add_argument("--traffic", action="store_true",
                   help="also optimize (no replay) and print the state bytes per call, stock against optimized")
    args = ap.parse_args(argv)
    if args.cmd == "plan":
        from cadence_fx.plan import plan  # deferred: --help answers without importing torch

        from cadence_fx.adapters.stepaudio2 import UpstreamNotFound  # deferred: as above
        from cadence_fx.contract import ContractError  # deferred: as above

        try:
            exported, contract = _load(args.target)
            print(plan(exported, contract))
            if args.traffic:
                from cadence_fx.plan import format_traffic, state_traffic  # deferred: as above
                from cadence_fx.program import optimize  # deferred: as above

                print()
                print(format_traffic(state_traffic(optimize(exported, contract, replay="off"))))
        except (_Usage, UpstreamNotFound, ContractError) as e:
            ap.error(str(e))  # exits 2 with the usage line
    return 0


if __name__ == "__main__":
    sys.exit(main())
