"""Corpus case: a tiny Llama decoding one token per call with transformers' ``StaticCache``, exported the
way transformers ships it for ExecuTorch (``transformers.integrations.executorch``).

``TorchExportableModuleForDecoderOnlyLM`` wraps the model in ``TorchExportableModuleWithStaticCache``,
which allocates a ``StaticCache`` of ``max_cache_len`` positions and registers each layer's key and
value tensors as module buffers (``key_cache_<i>``, ``value_cache_<i>``, ``(1, kv_heads, max_cache_len,
head_dim)``); its ``export`` exports that wrapper with ``torch.export`` (``strict=True``). Each call
writes the new token's keys and values in place at ``cache_position`` (``index_copy_`` on the buffer,
dim 2) and attends over the whole buffer under a position mask. The cache lives in the program's
module buffers, not in its inputs and outputs, so every cache tensor is declared as a region kept in a
module buffer (``Region(input=<buffer name>, output=None)``): a fixed-capacity ring written in place
(``Ring(max_cache_len)``, ``order=None``), full from the first call (the buffer is allocated whole).

The recipe also registers a per-layer ``cumulative_length_<i>`` buffer; the step overwrites it from
``cache_position`` (``copy_``) before reading it, so it carries nothing from one call to the next and
is not state.

Run ``python -m tests.corpus.static_cache_llm`` for the eager check: the exported program driven over
the stream gives the logits of the model's own full-sequence forward (no cache).
"""

from __future__ import annotations

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

import cadence_fx as cf
from tests.corpus import CorpusCase

MAX_CACHE_LEN = 16
CALLS = 16  # one token per call: the stream fills the cache
VOCAB = 64


def build_model() -> LlamaForCausalLM:
    """The upstream model at reduced sizes, random weights."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(config).eval()


def prompt() -> torch.Tensor:
    """The fixed stream of token ids, ``(1, CALLS)``."""
    return torch.randint(0, VOCAB, (1, CALLS), generator=torch.Generator().manual_seed(1))


def case() -> CorpusCase:
    model = build_model()
    tokens = prompt()
    layers = model.config.num_hidden_layers
    # user code begins
    model.generation_config.cache_implementation = "static"  # the recipe exports a StaticCache only
    recipe = TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=MAX_CACHE_LEN)
    contract = cf.Contract(
        clocks=(cf.Clock("token", 1, "tokens per call"),),
        regions=tuple(cf.Region(name, input=name, output=None, clock="token", axis=2, order=None,
                                retention=cf.Ring(MAX_CACHE_LEN), initial=MAX_CACHE_LEN)
                      for i in range(layers) for name in (f"key_cache_{i}", f"value_cache_{i}")),
        wrap=(cf.WHOLE_STEP,),
    )

    def export():
        return [recipe.export(input_ids=torch.tensor([[0]]), cache_position=torch.tensor([0]))]
    # user code ends

    return CorpusCase(
        name="static_cache_llm",
        upstream=f"transformers {transformers.__version__}: LlamaForCausalLM, "
                 "integrations.executorch.TorchExportableModuleForDecoderOnlyLM (StaticCache)",
        step=recipe.model,  # the TorchExportableModuleWithStaticCache that recipe.export exports
        contract=contract,
        export=export,
        inputs=lambda k: {"input_ids": tokens[:, k:k + 1], "cache_position": torch.tensor([k])},
        initial={},  # the program holds the cache in its module buffers
        calls=CALLS,
        notes="KV cache in module buffers written in place (Region output=None, Ring, order=None)",
    )


def _check() -> None:
    """The exported program over the stream against the model's own full-sequence forward."""
    c = case()
    ep = c.export()[0]
    sig = ep.graph_signature
    print("user inputs:", list(sig.user_inputs), "| mutated buffers (functional IR only):",
          dict(sig.buffers_to_mutate))
    names = [s.arg.name for s in sig.input_specs if s.kind.name == "USER_INPUT"]
    step = ep.module()
    with torch.no_grad():
        # the recipe exports with keyword arguments only (args=()): the program's module takes them so
        got = torch.cat([step(**{n: c.inputs(k)[n] for n in names}) for k in range(c.calls)], 1)
        want = build_model()(prompt()).logits
    err = (got - want).abs().max().item()
    print(f"decode logits {tuple(got.shape)} vs full forward: max abs diff {err:.3g}")
    assert got.shape == want.shape and err < 1e-5, err


if __name__ == "__main__":
    _check()
