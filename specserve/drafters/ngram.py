"""NGRAM: model-free drafts that continue the longest earlier match of the request's last tokens
(speculative/ngram_worker.py); the policy's rates are kept per match length (its hint)."""

from specserve.drafters.declaration import Drafter, Hints

DRAFTER = Drafter.lookup(
    "NGRAM",
    "continues the request's own earlier n-gram matches",
    "specserve.speculative.ngram_worker:make_worker",
    # per suffix-match length 0..4 (4: four or more): a guess without a match (a repeated token) almost never holds
    priors=(0.02, 0.2, 0.35, 0.5, 0.6),
    hints=Hints.EVERY_STEP,
)
