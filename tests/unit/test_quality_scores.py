"""The quality bench's teacher-forced scores (specserve/bench/quality.py) on hand-made logits."""

from __future__ import annotations

import math

import torch

from specserve.bench.quality import teacher_forced, top1_agreement, top1_paired


def _one_hot_logits(ids: list[int], vocab: int, guess) -> torch.Tensor:
    """Position i's logits put 4.0 on guess(i) (the next token it predicts), 0 elsewhere."""
    logits = torch.zeros(len(ids), vocab)
    for i in range(len(ids)):
        logits[i, guess(i)] = 4.0
    return logits


def test_scores_only_the_answer_from_the_position_before_each_token():
    ids, start, vocab = [5, 6, 1, 2, 3], 2, 8
    right = teacher_forced(lambda x: _one_hot_logits(x, vocab, lambda i: x[min(i + 1, len(x) - 1)]), [(ids, start)])
    scored, top1 = right
    p = math.exp(4.0) / (math.exp(4.0) + vocab - 1)
    assert scored["scored_tokens"] == 3
    assert math.isclose(scored["perplexity"], 1 / p, rel_tol=1e-9)
    assert top1[0].tolist() == [1, 2, 3]  # predicted at positions 1, 2, 3 for tokens 2, 3, 4


def test_top1_agreement_counts_positions_not_texts():
    reference = [torch.tensor([1, 2, 3]), torch.tensor([4])]
    assert top1_agreement(reference, reference) == 1.0
    assert top1_agreement(reference, [torch.tensor([1, 0, 3]), torch.tensor([0])]) == 2 / 4
    shifted = teacher_forced(lambda x: _one_hot_logits(x, 8, lambda i: x[i]), [([5, 6, 1, 2, 3], 2)])[1]
    assert top1_agreement([torch.tensor([1, 2, 3])], shifted) == 0.0  # an off-by-one read of the logits fails


def test_paired_counts_tell_who_alone_matched_the_reference():
    reference = [torch.tensor([1, 2, 3, 4])]
    ours, theirs = [torch.tensor([1, 2, 0, 0])], [torch.tensor([1, 0, 3, 0])]
    paired = top1_paired(reference, ours, theirs)
    assert (paired["only_ours"], paired["only_theirs"]) == (1, 1)  # position 0 both, position 3 neither
    assert math.isclose(paired["noise"], math.sqrt(2))
    assert top1_paired(reference, reference, theirs)["only_theirs"] == 0
