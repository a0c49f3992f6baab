"""STANDALONE: a smaller model of the target's family drafts one token per decode step of its own
(speculative/standalone_worker.py; loaded and checked by engine/draft_model.py)."""

from specserve.drafters.declaration import Cost, Drafter, DraftModel

DRAFTER = Drafter(
    name="STANDALONE",
    summary="a small draft model of the target's vocabulary",
    worker="specserve.engine.draft_model:standalone_worker",
    cost=Cost.MODEL,
    priors=(0.6,),  # a draft model of the target's family agrees with it on most tokens of most text
    draft_model="a GGUF with the target's vocabulary",
    draft_model_kind=DraftModel.MODEL_FILE,  # its K/V is private: valid per request, never cached
    drafts_in_one_pass=False,
)
