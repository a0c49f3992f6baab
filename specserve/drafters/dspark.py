"""DSPARK: the block drafter (docs/DSPARK.md): a small model over the target's hidden states drafts a
whole window in one pass; its K/V sits at the target's token slots (speculative/dspark_worker.py)."""

from specserve.drafters.declaration import Cost, Drafter, DraftModel

DRAFTER = Drafter(
    name="DSPARK",
    summary="block drafter over the target's hidden states",
    worker="specserve.speculative.dspark_worker:make_worker",
    cost=Cost.MODEL,
    priors=(0.35,),  # right on the first draft about a third of the time on chat
    draft_model="a drafter directory (make a random one with `specserve init-drafter --out DIR`)",
    draft_model_kind=DraftModel.CHECKPOINT,
    kv_in_prefix_cache=True,
)
