"""Every node's ids in one fixed width (`logits/node_ids.py`): processed rows equal to those each node's own ids give,
for Transformers' repetition penalty (with and without the prompt skipped) and the row-wise processors; the processors
that read the ids' order or count are named as unsupported."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
)

from hf_specdec.core.tree import HostTree
from hf_specdec.logits.node_ids import NodeIds, unsupported
from hf_specdec.logits.processing import row_processors

VOCAB = 12
#: a tree of 5 nodes: the root, two children of it, a child of each of those
PARENTS = [-1, 0, 0, 1, 2]


def _ancestors(parents: list[int]) -> torch.Tensor:
    """`(n, n)`: row i marks node i's ancestors, itself included, as a captured step's shape has them."""
    return HostTree(parents=parents).structure()[1]


def _own_ids(sequence: list[int], tokens: list[int], node: int) -> list[int]:
    path, at = [], node
    while at > 0:
        path.append(tokens[at])
        at = PARENTS[at]
    return sequence + path[::-1]


@pytest.mark.parametrize("ignore", [None, 0, 3, torch.tensor([2])])
def test_a_penalty_on_fixed_width_ids_is_the_penalty_on_each_nodes_own(ignore):
    """Five nodes after a committed sequence of 6 tokens in a buffer of 16 (stale tokens past it): each processed row
    equals the one its own ids (the sequence, then its path) give, whatever the prompt the penalty skips."""
    generator = torch.Generator().manual_seed(0)
    sequence = [3, 7, 7, 1, 9, 4]
    tokens = [4, 2, 5, 8, 2]  # the root is the sequence's last token
    processors = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.7, prompt_ignore_length=ignore),
                                      SuppressTokensLogitsProcessor([6]), TemperatureLogitsWarper(0.7),
                                      TopKLogitsWarper(5)])
    processors = row_processors(processors, 0, 1)
    ids = NodeIds(torch.tensor(sequence), 16, VOCAB)
    ids.write(torch.arange(6, 16), torch.full((10,), 11))  # stale rows: never read
    scores = torch.randn(len(tokens), VOCAB, generator=generator)
    fixed = processors(ids.of(torch.tensor(5), torch.tensor(tokens), _ancestors(PARENTS)), scores.clone())
    for node in range(len(tokens)):
        own = torch.tensor([_own_ids(sequence, tokens, node)])
        assert torch.equal(fixed[node], processors(own, scores[node : node + 1].clone())[0]), node
    root = processors(ids.of(torch.tensor(5)), scores[:1].clone())
    assert torch.equal(root[0], processors(torch.tensor([sequence]), scores[:1].clone())[0])


def test_an_unfilled_node_and_written_tokens():
    """A node the draft did not fill (-1) adds no id; written tokens extend the sequence the next rows read."""
    ids = NodeIds(torch.tensor([1, 2]), 6, VOCAB)
    out = ids.of(torch.tensor(1), torch.tensor([2, -1, 5]), _ancestors([-1, 0, 1]))
    assert out.tolist() == [[1, 2, VOCAB, VOCAB, VOCAB, VOCAB, VOCAB, VOCAB, VOCAB],
                            [1, 2, VOCAB, VOCAB, VOCAB, VOCAB, VOCAB, VOCAB, VOCAB],
                            [1, 2, VOCAB, VOCAB, VOCAB, VOCAB, VOCAB, VOCAB, 5]]
    ids.write(torch.tensor([2, 3]), torch.tensor([8, 9]))
    assert ids.of(torch.tensor(3))[0, :5].tolist() == [1, 2, 8, 9, VOCAB]


def test_processors_that_read_the_ids_order_or_count_are_named():
    processors = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.2), NoRepeatNGramLogitsProcessor(2),
                                      MinNewTokensLengthLogitsProcessor(3, 4, [0]), TemperatureLogitsWarper(0.5)])
    assert unsupported(processors) == ["NoRepeatNGramLogitsProcessor", "MinNewTokensLengthLogitsProcessor"]
    assert unsupported(None) == []
