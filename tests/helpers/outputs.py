"""Comparing two generate outputs field by field."""

from __future__ import annotations

import torch


def assert_outputs_equal(out, expected, tolerance: float = 1e-4, hidden_tolerance: float = 1e-5):
    """Same sequences; every per-token output plain returned, with its structure and values (None where plain's is):
    scores and logits within `tolerance`, hidden states and attention weights within `hidden_tolerance` (absolute;
    both relative `tolerance`)."""
    assert torch.equal(out.sequences, expected.sequences)
    for name in ("scores", "logits", "hidden_states", "attentions"):
        got_all, want_all = getattr(out, name), getattr(expected, name)
        if want_all is None:
            assert got_all is None, name
            continue
        assert len(got_all) == len(want_all), name  # one entry per new token
        per_layer = name in ("hidden_states", "attentions")
        for got, want in zip(got_all, want_all):
            if per_layer:
                assert len(got) == len(want), name
            for a, b in zip(got, want) if per_layer else [(got, want)]:
                assert a.shape == b.shape, name
                torch.testing.assert_close(a, b, rtol=tolerance, atol=hidden_tolerance if per_layer else tolerance)
