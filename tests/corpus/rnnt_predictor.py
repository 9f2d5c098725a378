"""torchaudio 2.9.1's RNN-T prediction network (``_Predictor``: embedding, layer-normed custom LSTMs).

Built by upstream's own factory, ``torchaudio.models.emformer_rnnt_model(...)`` at tiny sizes (its
``.predictor``; the Emformer transcriber and the joiner it also builds are not part of the step).
Greedy and beam-search RNN-T decoding (``RNNTBeamSearch``) call ``RNNT.predict(tokens, lengths,
state)``, i.e. ``_Predictor.forward``, once per emitted token, with ``state`` a list per LSTM layer
of ``[h, c]``, each ``(batch, lstm_hidden_dim)`` (the factory sets ``lstm_hidden_dim =
symbol_embedding_dim``), replaced whole every call; ``None`` at the start
means zeros (``_CustomLSTM.forward``), which is what the stream's initial state holds.

Each ``h`` and ``c`` is recurrent state: no axis grows, so it is declared as a ``Ring`` over its size-1
batch axis (capacity 1, ``initial=1``, ``order=None``: the model never concatenates it). The
``lengths`` output is the ``lengths`` input, returned as it is.
"""

from __future__ import annotations

import torch

import cadence_fx as cf
from tests.corpus import CorpusCase
from tests.corpus import _torchaudio

SYMBOLS, ENCODING, HIDDEN, LSTM_LAYERS = 32, 16, 8, 2  # the factory's LSTM width is its symbol_embedding_dim
CALLS = 12


def build_predictor() -> torch.nn.Module:
    torch.manual_seed(0)
    ta = _torchaudio.load()
    rnnt = ta.rnnt.emformer_rnnt_model(
        input_dim=8, encoding_dim=ENCODING, num_symbols=SYMBOLS, segment_length=4, right_context_length=1,
        time_reduction_input_dim=8, time_reduction_stride=2, transformer_num_heads=2, transformer_ffn_dim=16,
        transformer_num_layers=1, transformer_dropout=0.0, transformer_activation="gelu",
        transformer_left_context_length=4, transformer_max_memory_size=0,
        transformer_weight_init_scale_strategy="depthwise", transformer_tanh_on_mem=True,
        symbol_embedding_dim=HIDDEN, num_lstm_layers=LSTM_LAYERS, lstm_layer_norm=True,
        lstm_layer_norm_epsilon=1e-3, lstm_dropout=0.0)
    return rnnt.predictor.eval()


def tokens(k: int) -> torch.Tensor:
    """Call ``k``'s token (the one the decoder emitted last), (1, 1)."""
    return torch.randint(0, SYMBOLS, (1, 1), generator=torch.Generator().manual_seed(100 + k))


# user code begins
class PredictorStep(torch.nn.Module):
    """(tokens, lengths, h0, c0, h1, c1, ...) -> (encoding, lengths, h0', c0', ...): one token per call."""

    def __init__(self, predictor):
        super().__init__()
        self.predictor = predictor

    def forward(self, tokens, lengths, *state):
        out, lengths, new = self.predictor(tokens, lengths, [list(state[i:i + 2]) for i in range(0, len(state), 2)])
        return (out, lengths, *[t for h_c in new for t in h_c])


def predictor_contract(layers):
    return cf.Contract(
        clocks=(cf.Clock("token", 1, "tokens per call"),),
        regions=tuple(cf.Region(f"layer{i // 2}_{'hc'[i % 2]}", input=f"state_{i}", output=2 + i, clock="token",
                                axis=0, order=None, retention=cf.Ring(1), initial=1) for i in range(2 * layers)),
        wrap=(cf.WHOLE_STEP,))


def export(step, contract, hidden):
    example = {"tokens": tokens(0), "lengths": torch.tensor([1]),
               **{r.input: torch.zeros(1, hidden) for r in contract.regions}}
    return cf.export_catalog(step, contract, example)
# user code ends


def case() -> CorpusCase:
    step = PredictorStep(build_predictor()).eval()
    contract = predictor_contract(LSTM_LAYERS)
    return CorpusCase(
        name="rnnt_predictor",
        upstream=f"torchaudio {_torchaudio.VERSION}: torchaudio.models.rnnt._Predictor (from emformer_rnnt_model)",
        step=step,
        contract=contract,
        export=lambda: export(step, contract, HIDDEN),
        inputs=lambda k: {"tokens": tokens(k), "lengths": torch.tensor([1])},
        initial={r.input: torch.zeros(1, HIDDEN) for r in contract.regions},
        calls=CALLS,
        notes="torchaudio's model files loaded without its C extension; LSTM (h, c) as Ring(1) recurrent regions",
    )
