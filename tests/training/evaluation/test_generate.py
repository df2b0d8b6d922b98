"""megatron-md generate: the sampling rules and the decoding loop (the CLI end to end, against
transformers' greedy decoding, is in tests/convert/test_hf_convert.py)."""

from __future__ import annotations

import pytest
import torch

from megatron_md.training.evaluation.generate import SamplingOptions, choose, generate_ids


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_greedy_and_filters():
    logits = torch.tensor([0.1, 2.0, 1.9, -1.0, float("-inf")])
    assert choose(logits, SamplingOptions(temperature=0.0), _gen()) == 1
    # top-k 1 and a tiny nucleus leave only the argmax, whatever the seed
    for seed in range(20):
        assert choose(logits, SamplingOptions(temperature=1.0, top_k=1), _gen(seed)) == 1
        assert choose(logits, SamplingOptions(temperature=1.0, top_p=0.01), _gen(seed)) == 1
    picks = {choose(logits, SamplingOptions(temperature=1.0, top_k=2), _gen(s)) for s in range(50)}
    assert picks == {1, 2}  # only the two best, and both occur
    many = [choose(logits, SamplingOptions(temperature=5.0), _gen(s)) for s in range(200)]
    assert 4 not in many and len(set(many)) == 4  # masked (padded) rows are never drawn


class _Counter(torch.nn.Module):
    """Logits favouring (last token + 1) mod 8 over a padded vocabulary of 10; records window lengths."""

    def __init__(self):
        super().__init__()
        self.windows = []

    def forward(self, tokens, pos, mask):
        self.windows.append(tokens.shape[1])
        assert torch.equal(pos[0], torch.arange(tokens.shape[1]))
        out = torch.zeros(1, tokens.shape[1], 10)
        out[0, -1, (int(tokens[0, -1]) + 1) % 8] = 5.0
        out[0, -1, 9] = 100.0  # a padding row: must be masked out
        return out


def test_loop_windows_stops_at_eos_and_is_reproducible():
    model = _Counter()
    new = generate_ids(model, [5], SamplingOptions(max_new_tokens=6), seq_length=4, vocab=8, eos=None, device="cpu")
    assert new == [6, 7, 0, 1, 2, 3] and max(model.windows) == 4
    assert generate_ids(_Counter(), [5], SamplingOptions(max_new_tokens=6), seq_length=4, vocab=8, eos=0,
                        device="cpu") == [6, 7]
    opts = SamplingOptions(max_new_tokens=5, temperature=3.0, seed=7)
    a = generate_ids(_Counter(), [1], opts, seq_length=4, vocab=8, eos=None, device="cpu")
    b = generate_ids(_Counter(), [1], opts, seq_length=4, vocab=8, eos=None, device="cpu")
    assert a == b and all(0 <= t < 8 for t in a)


@pytest.mark.parametrize("bad", [dict(max_new_tokens=0), dict(temperature=-1.0), dict(top_p=0.0), dict(top_k=-2)])
def test_bad_options_name_the_flag(bad):
    with pytest.raises(ValueError, match="--"):
        SamplingOptions(**bad).validate()
